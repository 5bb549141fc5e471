"""`swarmctl serve …`: deploy an HTTP service on the swarm and reach it through any member's
gateway (http://127.0.0.1:8080/NAME/…); list, show, logs, scale, take down.

`serve up` packs and uploads the workdir as `jobs run` does (jobs.py), checks each replica's
job fields here (the daemon checks them again), and, with `--access token`, makes a token,
sends only its SHA-256 and prints the token once: the swarm never holds it.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import sys
from pathlib import Path
from typing import Any

from swarmd.rpc.client import Client

from . import render, render_serve
from .jobs import EXIT_OK, EXIT_USAGE, UsageError, _pairs, _upload

_UP: argparse.ArgumentParser | None = None  # `serve up`'s parser: its flags after NAME are read again (params)
SPEC_FIELDS = ("name", "replicas", "cmd", "env", "cpus", "mem", "gpus_per_node", "labels", "hosts", "python",
               "workdir", "health", "access", "target_inflight", "slo_p99", "predictive", "season")


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    sv = sub.add_parser("serve", parents=[common],
                        help="HTTP services on the swarm, reached through any member's gateway")
    ssub = sv.add_subparsers(dest="serve_command", metavar="ACTION", required=True)
    up = ssub.add_parser("up", parents=[common],
                         help="deploy a service (again: roll out the change replica by replica): "
                              "swarmctl serve up NAME [opts] -- CMD ARGS (it listens on $PORT)")
    up.add_argument("name", nargs="?", help="the service's name: the first segment of its URLs")
    up.add_argument("--replicas", metavar="N|MIN:MAX",
                    help="how many replicas, each on its own host (default 1); MIN:MAX autoscales between them")
    up.add_argument("--target-inflight", type=float, metavar="N",
                    help="autoscaling: requests in flight per replica to aim at (default 4)")
    up.add_argument("--slo-p99", metavar="TIME", help="autoscaling: a p99 latency over this adds a replica, e.g. 500ms")
    up.add_argument("--predictive", choices=("on", "off"),
                    help="autoscaling: also scale ahead of the demand its history forecasts (default off)")
    up.add_argument("--season", metavar="TIME", help="autoscaling: the forecast's season (default 24h)")
    up.add_argument("--cpus", type=float, metavar="C", help="free cores each replica's host must have")
    up.add_argument("--mem", metavar="SIZE", help="free memory each replica's host must have, e.g. 2G")
    up.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs for each replica")
    up.add_argument("--label", action="append", dest="labels", metavar="K=V", help="hosts must carry this label")
    up.add_argument("--host", action="append", dest="hosts", metavar="PEER", help="run only on these members")
    up.add_argument("--env", action="append", metavar="K=V", help="environment for every replica")
    up.add_argument("--workdir", metavar="DIR", help="directory shipped to every replica's host")
    up.add_argument("--python", metavar="PATH", help="interpreter for a leading `python` in CMD")
    up.add_argument("--health", metavar="PATH", help="the path hosts GET to check a replica (default /)")
    up.add_argument("--access", choices=("members", "token", "public"),
                    help="who gateways serve: members (requests from a member's own machine, the default), "
                         "token (anyone with the token printed now), public (anyone)")
    up.add_argument("--spec", type=Path, metavar="FILE", help="a YAML service spec; flags override it")
    up.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command each replica runs")
    global _UP
    _UP = up
    ssub.add_parser("ls", parents=[common], help="the services in the swarm's registry")
    show = ssub.add_parser("show", parents=[common],
                           help="one service: replicas, hosts, paths, health, and this gateway's figures")
    show.add_argument("name")
    logs = ssub.add_parser("logs", parents=[common], help="a replica's output")
    logs.add_argument("name")
    logs.add_argument("--replica", type=int, default=0, metavar="K", help="its index (default 0)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep following until it ends")
    scale = ssub.add_parser("scale", parents=[common],
                            help="change how many replicas a service has: N (fixed) or MIN:MAX (autoscaled)")
    scale.add_argument("name")
    scale.add_argument("replicas", metavar="N|MIN:MAX")
    down = ssub.add_parser("down", parents=[common], help="drain and stop every replica of a service")
    down.add_argument("name")


def command(client: Client, args: argparse.Namespace) -> int:
    match args.serve_command:
        case "up":
            return _up(client, args)
        case "ls":
            result = client.call("serve.ls")
            render.as_json(result) if args.json else render_serve.services(result["services"])
        case "show":
            result = client.call("serve.show", name=args.name)
            render.as_json(result) if args.json else render_serve.service(result)
        case "logs":
            if args.follow:
                client.set_timeout(max(args.timeout, 30.0))
            for event in client.stream("serve.logs", name=args.name, replica=args.replica, follow=args.follow):
                if args.json:
                    render.as_json(event)
                elif "out" in event:
                    tty = sys.stdout.isatty()
                    for _, text in event["out"]:
                        sys.stdout.write(f"{render.plain(text) if tty else text}\n")
                    sys.stdout.flush()
        case "scale":
            try:
                count, autoscale = replicas(args.replicas)
            except UsageError as exc:
                print(f"swarmctl: {exc}", file=sys.stderr)
                return EXIT_USAGE
            result = client.call("serve.scale", name=args.name,
                                 **({"autoscale": autoscale} if autoscale else {"replicas": count}))
            if args.json:
                render.as_json(result)
            else:
                a = result.get("autoscale")
                print(f"{result['name']}: {result['replicas']} replica(s)"
                      + (f", autoscaled {a['min']}-{a['max']}" if a else ""))
        case "down":
            result = client.call("serve.down", name=args.name)
            render.as_json(result) if args.json else print(f"{result['name']}: draining, then stopped")
    return EXIT_OK


def params(args: argparse.Namespace) -> dict[str, Any]:
    """serve.up's parameters from the flags over the spec file, each replica's job fields checked."""
    from swarmd.compute.spec import SpecError, build, load_yaml

    given: dict[str, Any] = {}
    if args.spec is not None:
        try:
            text = args.spec.read_text()
        except OSError as exc:
            raise UsageError(f"--spec {args.spec}: {exc.strerror}") from None
        try:
            given = load_yaml(text, str(args.spec))
        except SpecError as exc:
            raise UsageError(str(exc)) from None
        if unknown := sorted(set(given) - set(SPEC_FIELDS)):
            raise UsageError(f"{args.spec}: unknown field {unknown[0]!r} (a service spec has {', '.join(SPEC_FIELDS)})")
    # argparse hands everything after NAME to the command: the flags among it come back here
    rest = list(args.cmd)
    if "--" in rest:
        before, cmd = rest[:rest.index("--")], rest[rest.index("--") + 1:]
    else:
        before, cmd = (rest, []) if rest[:1] and rest[0].startswith("-") else ([], rest)
    if before:
        assert _UP is not None
        name = args.name
        _UP.parse_args(before, namespace=args)
        args.name = args.name or name
    flags = {"name": args.name, "replicas": args.replicas, "cpus": args.cpus, "mem": args.mem,
             "target_inflight": args.target_inflight, "slo_p99": args.slo_p99, "season": args.season,
             "predictive": None if args.predictive is None else args.predictive == "on",
             "gpus_per_node": args.gpus_per_node, "python": args.python, "workdir": args.workdir,
             "health": args.health, "access": args.access, "cmd": cmd or None,
             "labels": _pairs(args.labels, "--label"), "env": _pairs(args.env, "--env"),
             "hosts": None if not args.hosts else [h.strip() for a in args.hosts for h in a.split(",") if h.strip()]}
    merged = {**given, **{k: v for k, v in flags.items() if v is not None}}
    if not merged.get("name"):
        raise UsageError("serve up: the service's NAME is missing (swarmctl serve up NAME … -- CMD)")
    if "cmd" not in merged:
        raise UsageError("serve up: the command is missing: swarmctl serve up NAME [opts] -- CMD ARGS")
    template = {k: merged[k] for k in ("cmd", "env", "cpus", "mem", "gpus_per_node", "labels", "hosts", "python")
                if k in merged}
    try:
        template = {k: v for k, v in build(template, {}).to_wire().items() if k in template}
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    count, autoscale = replicas(merged.get("replicas", 1))
    tuning = {k: merged[k] for k in ("target_inflight", "slo_p99", "predictive", "season") if k in merged}
    if tuning and autoscale is None:
        raise UsageError(f"serve up: --{next(iter(tuning)).replace('_', '-')} is for an autoscaled service: "
                         "give --replicas MIN:MAX")
    if autoscale is not None:
        autoscale |= _tuning(tuning)
    out = {"name": merged["name"], "replicas": count, "template": template, "autoscale": autoscale,
           "health": merged.get("health"), "access": merged.get("access", "members"), "workdir": merged.get("workdir")}
    return {k: v for k, v in out.items() if v is not None}


def replicas(value: Any) -> tuple[int | None, dict[str, Any] | None]:
    """`N` (a fixed count) or `MIN:MAX` (autoscaled between them, starting at MIN)."""
    text = str(value).strip()
    low, sep, high = text.partition(":")
    try:
        if not sep:
            return int(low), None
        return None, {"min": int(low), "max": int(high)}
    except ValueError:
        raise UsageError(f"--replicas: N or MIN:MAX (e.g. 3 or 1:8), got {text!r:.40}") from None


def _tuning(given: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "target_inflight" in given:
        try:
            out["target_inflight"] = float(given["target_inflight"])
        except (TypeError, ValueError):
            raise UsageError(f"--target-inflight: a number, got {given['target_inflight']!r:.40}") from None
    if "slo_p99" in given:
        out["slo_p99_ms"] = _milliseconds(given["slo_p99"], "--slo-p99")
    if "season" in given:
        out["season_s"] = _milliseconds(given["season"], "--season") / 1000
    if "predictive" in given:
        if not isinstance(given["predictive"], bool):
            raise UsageError("predictive: on or off")
        out["predictive"] = given["predictive"]
    return out


_UNITS_MS = {"ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0, "d": 86_400_000.0}


def _milliseconds(value: Any, flag: str) -> float:
    """Milliseconds from 500ms, 0.5s, 10m, 24h or a plain number of milliseconds."""
    text = str(value).strip().lower()
    for unit in ("ms", "s", "m", "h", "d"):
        if text.endswith(unit):
            number, factor = text[:-len(unit)], _UNITS_MS[unit]
            break
    else:
        number, factor = text, 1.0
    try:
        ms = float(number) * factor
    except ValueError:
        raise UsageError(f"{flag}: a time such as 500ms, 2s or 24h, got {value!r:.40}") from None
    if not 0 < ms < float("inf"):
        raise UsageError(f"{flag}: a positive time, got {value!r:.40}")
    return ms


def _up(client: Client, args: argparse.Namespace) -> int:
    from rich.console import Console

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        p = params(args)
        if p.get("workdir"):
            p["workdir"] = _upload(client, p["workdir"], err)
    except UsageError as exc:
        print(f"swarmctl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    token = None
    if p["access"] == "token":
        token = secrets.token_urlsafe(32)
        p["token_sha256"] = hashlib.sha256(token.encode()).hexdigest()
    result = client.call("serve.up", **p)
    if args.json:
        render.as_json({**result, **({"token": token} if token else {})})
        return EXIT_OK
    what = "rolling out" if result.get("rolling") else "up"
    print(f"{result['name']}: {what}, {result['replicas']} replica(s), generation {result['generation']}")
    print(f"  curl http://127.0.0.1:8080/{result['name']}/   (on any member)")
    if token:
        print(f"  token: {token}   (send it as 'Authorization: Bearer …'; the swarm keeps only its hash)")
    return EXIT_OK

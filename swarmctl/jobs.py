"""`swarmctl jobs …`: run a job across the swarm and follow it; list, show, logs, cancel;
forward a port of a running job (forward.py).

`jobs run` packs the workdir here (the daemon may not be able to read it), uploads it in
chunks unless the daemon already has that digest, then streams progress to stderr and the
ranks' output, prefixed `[rank K]`, to stdout. It exits with the job's exit code. Ctrl-C
asks whether to cancel the job or leave it running (detach).

Ctrl-C is handled explicitly (`CtrlC`), before anything is printed: a SIGINT disposition
inherited as ignored (a shell without job control starts background commands so, and every
process they exec keeps it) would otherwise swallow the user's Ctrl-C at the terminal.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from swarmd.rpc.client import Client

from . import render, render_jobs

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    jb = sub.add_parser("jobs", parents=[common], help="run multi-node torch.distributed jobs; list, logs, cancel")
    jsub = jb.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    run = jsub.add_parser("run", parents=[common], help="run CMD on the swarm: swarmctl jobs run [opts] -- CMD ARGS…")
    run.add_argument("--nodes", metavar="N|MIN:MAX", help="hosts: N, or MIN:MAX to start on as many as fit up to MAX "
                     "and go on with at least MIN after a loss (default 1)")
    run.add_argument("--max-restarts", metavar="K", help="restart the job up to K times after a lost host or a "
                     "failed rank, from its last checkpoint (default 0)")
    run.add_argument("--no-grow", action="store_false", dest="grow", default=None,
                     help="with --nodes MIN:MAX, stay on the hosts it has: by default a job below MAX grows back "
                          "toward it at its next checkpoint when hosts are free again (one restart from that "
                          "checkpoint, at most once per the coordinator's job_grow_every, 5 min by default)")
    run.add_argument("--groups", metavar="auto|off|MS", help="tell the ranks which hosts are near each other: "
                     "groups by measured RTT, none spanning a link slower than MS (auto: 30 ms); a script using "
                     "swarmd.train syncs every step inside a group and every H steps across (default off)")
    run.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs on each host (default 0)")
    run.add_argument("--procs-per-node", type=int, metavar="P", help="ranks on each host (default G, or 1)")
    run.add_argument("--cpus", type=float, metavar="C", help="free cores each host must have")
    run.add_argument("--mem", metavar="SIZE", help="free memory each host must have, e.g. 8G")
    run.add_argument("--label", action="append", dest="labels", metavar="K=V", help="hosts must carry this label")
    run.add_argument("--host", action="append", dest="hosts", metavar="PEER",
                     help="run only on this member (a full peer id; repeatable, or A,B): the hosts you trust")
    run.add_argument("--env", action="append", metavar="K=V", help="environment for every rank")
    run.add_argument("--workdir", metavar="DIR", help="directory shipped to every host (default: none)")
    run.add_argument("--name", metavar="NAME", help="a name to find the job by")
    run.add_argument("--wait", metavar="DURATION", help="wait this long for capacity (e.g. 10m) instead of failing")
    run.add_argument("--python", metavar="PATH", help="interpreter for a leading `python` in CMD")
    run.add_argument("--spec", type=Path, metavar="FILE", help="a YAML job spec; flags override it")
    run.add_argument("--detach", action="store_true", help="print the job id and return")
    run.add_argument("--ray", action="store_true", default=None,
                     help="start a Ray cluster for this job alone (a Ray node on each host) and run CMD as its "
                          "driver on the first host; ray.init() connects with no arguments")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command each rank runs")
    lsp = jsub.add_parser("ls", parents=[common], help="your jobs coordinated by this node (every job for root)")
    lsp.add_argument("--limit", type=int, default=50)
    show = jsub.add_parser("show", parents=[common], help="one job: nodes, ranks, exit codes, why")
    show.add_argument("id")
    logs = jsub.add_parser("logs", parents=[common], help="a job's output")
    logs.add_argument("-f", "--follow", action="store_true", help="keep following until the job ends")
    logs.add_argument("--rank", type=int, metavar="K", help="only rank K")
    logs.add_argument("id")
    cancel = jsub.add_parser("cancel", parents=[common], help="stop a job (SIGTERM, then SIGKILL)")
    cancel.add_argument("id")
    fw = jsub.add_parser("forward", parents=[common],
                         help="forward 127.0.0.1:LOCAL_PORT here to REMOTE_PORT on a running job's first host "
                              "(a Ray job's head) until Ctrl-C")
    fw.add_argument("id")
    fw.add_argument("ports", metavar="LOCAL_PORT[:REMOTE_PORT]", help="REMOTE_PORT defaults to LOCAL_PORT")


def command(client: Client, args: argparse.Namespace) -> int:
    match args.jobs_command:
        case "run":
            return _run(client, args)
        case "ls":
            result = client.call("jobs.ls", limit=args.limit)
            render.as_json(result) if args.json else render_jobs.jobs(result["jobs"])
        case "show":
            result = client.call("jobs.show", id=args.id)
            render.as_json(result) if args.json else render_jobs.job(result)
        case "logs":
            return _logs(client, args)
        case "forward":
            from . import forward

            return forward.command(client, args)
        case "cancel":
            result = client.call("jobs.cancel", id=args.id)
            render.as_json(result) if args.json else print(f"job {result['id']}: {result['state']}, cancelling")
    return EXIT_OK


class UsageError(Exception):
    pass


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    from swarmd.compute.spec import SpecError, build, load_yaml

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    file_fields: dict[str, Any] = {}
    try:
        if args.spec is not None:
            try:
                text = args.spec.read_text()
            except OSError as exc:
                raise UsageError(f"--spec {args.spec}: {exc.strerror}") from None
            file_fields = load_yaml(text, str(args.spec))
        flags = {"nodes": args.nodes, "max_restarts": args.max_restarts, "gpus_per_node": args.gpus_per_node, "procs_per_node": args.procs_per_node,
                 "cpus": args.cpus, "mem": args.mem, "name": args.name, "wait": args.wait, "python": args.python,
                 "workdir": args.workdir, "ray": args.ray, "grow": args.grow, "groups": args.groups,
                 "cmd": cmd or None,
                 "labels": _pairs(args.labels, "--label"), "env": _pairs(args.env, "--env"),
                 "hosts": None if not args.hosts else [h.strip() for a in args.hosts for h in a.split(",") if h.strip()]}
        return build(file_fields, flags).to_wire()
    except SpecError as exc:
        raise UsageError(str(exc)) from None


def _pairs(items: list[str] | None, flag: str) -> dict[str, str] | None:
    if not items:
        return None
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag}: expected K=V, got {item!r}")
        out[key] = value
    return out


def _upload(client: Client, workdir: str, err: Any) -> str:
    from swarmd.client import send_workdir
    from swarmd.compute.workdir import WorkdirError, pack

    try:
        packed = pack(Path(workdir))
    except WorkdirError as exc:
        raise UsageError(str(exc)) from None
    err.print(f"workdir {workdir}: {packed.files} files, {render.size(packed.size)} "
              f"({render.size(len(packed.data))} packed), sha256 {packed.digest[:12]}")
    send_workdir(client, packed)
    return packed.digest


class CtrlC:
    """SIGINT while `jobs run` runs.

    A Ctrl-C raises KeyboardInterrupt as usual, except from the moment the request is sent
    until the daemon names the job: the job may exist then, and quitting would leave it
    running unseen, so the press is held and acted on as soon as the id arrives (`named`).
    A second press while one is held quits at once.

    Installed only when this process is in its terminal's foreground process group: a
    Ctrl-C typed there is meant for it, whatever disposition it inherited. A process in the
    background, or with no terminal, keeps the disposition it was given.
    """

    def __init__(self) -> None:
        self.holding = False
        self.held = False

    @classmethod
    def install(cls) -> CtrlC:
        ctrl_c = cls()
        if in_foreground():
            signal.signal(signal.SIGINT, ctrl_c._handle)
        return ctrl_c

    def _handle(self, signum: int, frame: Any) -> None:
        if self.holding and not self.held:
            self.held = True
            return
        raise KeyboardInterrupt

    def hold(self) -> None:
        self.holding = True

    def named(self) -> None:
        """The daemon named the job: a held Ctrl-C is acted on now."""
        self.holding = False
        if self.held:
            self.held = False
            raise KeyboardInterrupt


def in_foreground() -> bool:
    """This process is in its terminal's foreground process group: a Ctrl-C typed there is for it."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False


def _run(client: Client, args: argparse.Namespace) -> int:
    ctrl_c = CtrlC.install()  # before anything is printed: see the module header
    from rich.console import Console
    from rich.text import Text

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        spec = _spec(args)
        digest = _upload(client, spec["workdir"], err) if spec.get("workdir") else None
    except UsageError as exc:
        print(f"swarmctl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    client.set_timeout(max(args.timeout, 30.0))  # progress comes at least every second
    params: dict[str, Any] = {"spec": spec, "detach": args.detach}
    if digest is not None:
        params["workdir"] = digest
    stream = client.stream("jobs.run", **params)
    job = None
    shown = None  # the state last told on stderr
    started = time.monotonic()
    status = err.status("placing…") if not args.json and err.is_terminal else None
    if status is not None:
        status.start()
    try:
        ctrl_c.hold()  # the request goes with the stream's first step: from then on the job may exist
        for event in stream:
            if args.json:
                render.as_json(event)
            if "submitted" in event:
                job = event["submitted"]
                if args.detach and not args.json:
                    print(job)
                ctrl_c.named()
            elif "job" in event and not args.json:
                line = render.plain(render_jobs.job_progress(event["job"]))
                state = render_jobs.state_text(event["job"])
                if status is not None:
                    status.update(Text(line))
                    if event["job"]["state"] == "running":
                        status.stop()
                        status = None
                        err.print(line, markup=False)
                elif state != shown and event["job"]["state"] in ("restarting", "running"):
                    err.print(line, markup=False)  # a restart and the run after it, once each, between the output lines
                shown = state
            elif "out" in event and not args.json:
                if status is not None:
                    status.stop()
                    status = None
                _write_output(event["out"], None)
            elif "end" in event:
                if status is not None:
                    status.stop()
                    status = None
                end = event["end"]
                if not args.json:
                    err.print(render.plain(render_jobs.job_summary(end, time.monotonic() - started)), markup=False)
                code = end.get("exit_code")
                return EXIT_FAILED if code is None else min(int(code), 255)
    except KeyboardInterrupt:
        if status is not None:
            status.stop()
        return _interrupted(job, args, err)
    return EXIT_OK


def _interrupted(job: str | None, args: argparse.Namespace, err: Any) -> int:
    if job is None:
        err.print("interrupted before the daemon named the job; if it was submitted it goes on: swarmctl jobs ls")
        return 130
    answer = "d"
    if sys.stdin.isatty():
        try:
            answer = input(f"\njob {job} is still running: [c]ancel it or [d]etach? ").strip().lower()[:1] or "d"
        except (EOFError, KeyboardInterrupt):
            answer = "d"
    if answer == "c":
        from swarmd.paths import client_socket

        with Client(str(getattr(args, "socket", None) or client_socket(os.environ)), timeout=args.timeout) as c:
            c.call("jobs.cancel", id=job)
        err.print(f"job {job} cancelled")
    else:
        err.print(f"detached; job {job} goes on. Follow it with: swarmctl jobs logs -f {job}")
    return 130


def _logs(client: Client, args: argparse.Namespace) -> int:
    if args.follow:
        client.set_timeout(max(args.timeout, 30.0))
    params: dict[str, Any] = {"id": args.id, "follow": args.follow}
    if args.rank is not None:
        params["rank"] = args.rank
    for event in client.stream("jobs.logs", **params):
        if args.json:
            render.as_json(event)
        elif "out" in event:
            _write_output(event["out"], args.rank)
    return EXIT_OK


def _write_output(lines: list[list[Any]], rank: int | None) -> None:
    """Rank output as the ranks wrote it, prefixed with the rank unless one was asked for. On a
    terminal, control characters show as escapes: a job's output may not write the user's
    clipboard (OSC 52), retitle the window or paint over a line; piped, it is passed unchanged."""
    tty = sys.stdout.isatty()
    for r, text in lines:
        text = render.plain(text) if tty else text
        sys.stdout.write(f"{text}\n" if rank is not None else f"[rank {r}] {text}\n")
    sys.stdout.flush()

"""`swarm-sim`: the network lab and the simulator (`run`). Thin: parse, act, render."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    name = argparse.ArgumentParser(add_help=False)
    name.add_argument("--name", default="lab", help="which lab (default: lab); several can coexist")
    p = argparse.ArgumentParser(prog="swarm-sim", description="Try a swarm before deploying it.")
    top = p.add_subparsers(dest="area", metavar="AREA", required=True)
    lab = top.add_parser("lab", help="real daemons on an emulated wide-area network")
    sub = lab.add_subparsers(dest="command", metavar="COMMAND", required=True)

    up = sub.add_parser("up", parents=[name], help="create hosts, links and daemons")
    up.add_argument("--hosts", type=int, required=True, metavar="N")
    rtt = up.add_mutually_exclusive_group()
    rtt.add_argument("--rtt-ms", type=float, default=None, metavar="MS", help="the same RTT on every link (default 20)")
    rtt.add_argument("--rtt-matrix", type=Path, metavar="FILE.csv", help="square CSV of RTTs in ms, no header")
    rtt.add_argument("--countries", metavar="DE,US,JP", help="host i sits in the i-th country; measured RTTs")
    up.add_argument("--loss", type=float, default=0.0, metavar="PCT")
    up.add_argument("--bandwidth", type=float, default=None, metavar="MBIT")
    up.add_argument("--no-daemons", action="store_true", help="the network only")
    up.add_argument("--no-mesh", action="store_true", help="daemons without the WireGuard mesh")
    up.add_argument("--nat", metavar="h2=eim-apdf,h3=edm,...",
                    help="hosts behind a router: eim (full cone), eim-adf (address-restricted), eim-apdf "
                         "(port-restricted, a home router), edm (symmetric), firewall (no translation, "
                         "inbound dropped); the rest stay public, at least one must")
    up.add_argument("--nat-udp-timeout", type=int, default=30, metavar="SECONDS",
                    help="the routers' conntrack timeout for a UDP flow seen one way (default 30, Linux's)")
    up.add_argument("--nat-udp-stream-timeout", type=int, default=120, metavar="SECONDS",
                    help="... for an assured UDP flow, replies for more than 2 s (default 120, Linux's)")

    ex = sub.add_parser("exec", parents=[name], help="run a command inside a host's namespace")
    ex.add_argument("host")
    ex.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD")

    ln = sub.add_parser("link", parents=[name], help="change one link at run time")
    ln.add_argument("a")
    ln.add_argument("b")
    ln.add_argument("--rtt-ms", type=float, metavar="MS")
    ln.add_argument("--loss", type=float, metavar="PCT")
    ln.add_argument("--bandwidth", type=float, metavar="MBIT")
    state = ln.add_mutually_exclusive_group()
    state.add_argument("--down", dest="up", action="store_false", default=None)
    state.add_argument("--up", dest="up", action="store_true")

    kill = sub.add_parser("kill", parents=[name], help="signal a host's daemon")
    kill.add_argument("host")
    kill.add_argument("--signal", default="TERM", choices=["KILL", "TERM", "STOP", "CONT"])
    start = sub.add_parser("start", parents=[name], help="restart a host's daemon (same identity)")
    start.add_argument("host")
    crash = sub.add_parser("crash", parents=[name],
                           help="power a host off silently: links cut (no FIN, no RST), every process SIGKILLed")
    crash.add_argument("host")
    revive = sub.add_parser("revive", parents=[name], help="power a crashed host on: links restored, daemon started")
    revive.add_argument("host")
    nat = sub.add_parser("nat", parents=[name], help="act on a host's NAT router")
    nat.add_argument("host")
    nat.add_argument("action", choices=["rebind"],
                     help="rebind: the router forgets its mappings and gives the host new external ports")
    st = sub.add_parser("status", parents=[name], help="hosts and links")
    st.add_argument("--json", action="store_true")
    sub.add_parser("down", parents=[name], help="remove everything the lab made")

    run = top.add_parser("run", help="a scenario: the daemon's membership core on thousands of simulated nodes",
                         description="Run a scenario (sim/scenarios/*.toml are examples): prints a summary, "
                                     "writes DIR/report.json (the same bytes for the same seed) and PNG plots.")
    run.add_argument("scenario", type=Path, metavar="SCENARIO.toml",
                     help="a scenario file, or the name of a shipped one (small, lab-5-countries, swarm-2k, ...)")
    run.add_argument("--seed", type=int, default=None, metavar="S", help="overrides the scenario's seed")
    run.add_argument("--out", type=Path, default=None, metavar="DIR", help="default: sim-out/<scenario name>")
    run.add_argument("--no-plots", action="store_true", help="report.json and the summary only")
    return p


def _check_range(value: float | None, low: float, high: float, flag: str) -> None:
    if value is not None and not low <= value <= high:
        raise SystemExit(f"swarm-sim: {flag} must be between {low:g} and {high:g}, got {value:g}")


def split_exec(words: list[str]) -> tuple[list[str], list[str]]:
    """The words after `lab exec`: (lab exec's own, options first and the host last; the
    command verbatim).

    Lab exec's words are its options (before or after the host) and the host; the command
    starts after the first `--`, or at the first other word after the host. Everything from
    there on is the command's, its own `--` and options included: argparse is never shown
    them (its REMAINDER handling of `--` differs between Python versions).
    """
    own: list[str] = []
    host: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return own + host, words[i + 1:]
        if word == "--name":
            own += words[i:i + 2]
            i += 2
        elif word.startswith("-"):  # --name=X, --help, or a mistake argparse will name
            own.append(word)
            i += 1
        elif host:
            return own + host, words[i:]
        else:
            host = [word]
            i += 1
    return own + host, []


def parse(argv: list[str]) -> argparse.Namespace:
    if argv[:2] == ["lab", "exec"]:
        own, command = split_exec(argv[2:])
        args = parser().parse_args(["lab", "exec", *own])
        args.argv = command
        return args
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.area == "run":
        return _run(args)
    from .netlab import lab as labmod
    from .netlab import nat as natmod
    from .netlab import topology
    from .netlab.state import LabState

    for flag in ("loss",):
        _check_range(getattr(args, flag, None), 0, 100, f"--{flag}")
    _check_range(getattr(args, "rtt_ms", None), 0, 10_000, "--rtt-ms")
    try:
        if args.command == "up":
            countries = None
            if args.countries:
                table = topology.country_table()
                countries = topology.check_countries(args.countries.split(","), table)
                rtt = topology.from_countries(table)
            elif args.rtt_matrix:
                rtt = topology.from_matrix_csv(args.rtt_matrix)
            else:
                rtt = topology.uniform(20.0 if args.rtt_ms is None else args.rtt_ms)
            hosts, links = topology.plan(args.hosts, rtt, loss_pct=args.loss, bandwidth_mbit=args.bandwidth,
                                         countries=countries)
            nat = natmod.parse_spec(args.nat, [h.name for h in hosts]) if args.nat else None
            timeouts = natmod.Timeouts(udp=args.nat_udp_timeout, udp_stream=args.nat_udp_stream_timeout)
            lab = labmod.Lab.up(args.name, hosts, links, daemons=not args.no_daemons, mesh=not args.no_mesh,
                                nat=nat, nat_timeouts=timeouts)
            if not args.no_daemons:
                took = lab.wait_formed()
                print(f"swarm formed {took:.1f} s after the daemons answered"
                      + (": every host meshed with every other" if not args.no_mesh else ""))
            _render_hosts(lab.status())
            return 0
        if args.command == "down":
            labmod.down(args.name)
            return 0
        state = LabState.load(args.name)
        if state is None:
            print(f"swarm-sim: no lab named {args.name!r} (start one with `swarm-sim lab up`)", file=sys.stderr)
            return 2
        lab = labmod.Lab(state)
        if args.command == "exec":
            argv = args.argv
            if not argv:
                print("swarm-sim: lab exec HOST -- CMD: no command given", file=sys.stderr)
                return 2
            return lab.exec(args.host, argv)
        if args.command == "link":
            link = lab.set_link(args.a, args.b, rtt_ms=args.rtt_ms, loss_pct=args.loss,
                                bandwidth_mbit=args.bandwidth, up=args.up)
            print(json.dumps(link.to_dict()))
            return 0
        if args.command == "kill":
            lab.kill(args.host, signal.Signals[f"SIG{args.signal}"])
            return 0
        if args.command == "start":
            lab.start(args.host)
            return 0
        if args.command == "crash":
            killed = lab.crash(args.host)
            cut = [f"{link.a}-{link.b}" for link in lab.state.links if args.host in (link.a, link.b)]
            print(f"{args.host} crashed: links {', '.join(cut) or 'none'} cut, {len(killed)} processes killed")
            return 0
        if args.command == "revive":
            lab.revive(args.host)
            print(f"{args.host} revived" + (": its daemon answers" if lab.state.daemons else ""))
            return 0
        if args.command == "nat":
            lab.rebind(args.host)
            h = lab.state.host(args.host)
            print(f"{args.host} rebound ({h.nat}, rebind {h.nat_generation}): external ports now "
                  f"{natmod.describe_ports(h.nat, h.nat_generation)}")
            return 0
        if args.command == "status":
            status = lab.status()
            if args.json:
                print(json.dumps(status, indent=2))
            else:
                _render_hosts(status)
                _render_links(status)
            return 0
    except labmod.LabError as exc:
        print(f"swarm-sim: {exc}", file=sys.stderr)
        return exc.status
    except (KeyError, ValueError) as exc:
        print(f"swarm-sim: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> int:
    from . import report
    from .runner import fits, place
    from .scenario import ScenarioError, load

    if args.seed is not None and not 0 <= args.seed < 2**63:
        print(f"swarm-sim: --seed must be 0..2^63-1, got {args.seed}", file=sys.stderr)
        return 2
    try:
        scenario = load(args.scenario)
        if args.seed is not None:
            scenario = scenario.with_seed(args.seed)
        if scenario.mode == "membership":
            nodes = scenario.nodes + scenario.joins
            ok, need, have = fits(nodes)
            if not ok:
                print(f"swarm-sim: {scenario.name}: {nodes:,} nodes, each holding every member, need about "
                      f"{need:.0f} GB of memory; {have:.0f} GB is available", file=sys.stderr)
                return 2
        out = args.out if args.out is not None else Path("sim-out") / scenario.name
        made = not out.exists()  # checked now, not after a long run; removed again if the run fails
        out.mkdir(parents=True, exist_ok=True)
    except ScenarioError as exc:
        print(f"swarm-sim: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"swarm-sim: --out {out}: cannot make the directory: {exc.strerror or exc}", file=sys.stderr)
        return 2
    console = _console(stderr=True)
    try:
        place(scenario)  # what only the placement can tell (a partition's country got no node), before the bar
        outcome = _simulate(scenario, console)
    except (ScenarioError, KeyboardInterrupt) as exc:
        if made:
            out.rmdir()
        if isinstance(exc, KeyboardInterrupt):
            print("swarm-sim: interrupted; nothing written", file=sys.stderr)
            return 130
        print(f"swarm-sim: {exc}", file=sys.stderr)
        return 2
    data = report.build(outcome)
    written = [out / "report.json"]
    try:
        report.write(written[0], data)
    except OSError as exc:
        print(f"swarm-sim: cannot write {written[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if not args.no_plots:
        try:
            from . import plots
            written += plots.write_all(outcome, out)
        except ImportError as exc:
            print(f"swarm-sim: no plots ({exc.name} is not installed: pip install 'swarmd[sim]')", file=sys.stderr)
    _render_summary(data, outcome, written)
    return 0


def _simulate(scenario, console):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .runner import run

    if not console.is_terminal:  # a log or a pipe: no bar to redraw
        return run(scenario)
    if scenario.mode == "disseminate":  # one record, no clock to show: a spinner
        with console.status(f"{scenario.name}: one record to {scenario.nodes:,} nodes"):
            return run(scenario)
    columns = (TextColumn("{task.description}"), BarColumn(),
               TextColumn("{task.completed:,.0f} / {task.total:,.0f} simulated s,"),
               TextColumn("wall"), TimeElapsedColumn(),
               TextColumn("{task.fields[speed]}"))
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(scenario.name, total=scenario.seconds, speed="")
        started = time.monotonic()

        def progress(now: float) -> None:
            wall = time.monotonic() - started
            bar.update(task, completed=now, speed=f"{now / wall:,.1f}x" if wall > 0 else "")
        return run(scenario, progress)


def _render_summary(data: dict, outcome, written: list[Path]) -> None:
    from rich.table import Table

    from .report import rows

    t = Table(title=f"swarm-sim run {data['scenario']['name']}")
    for col in ("figure", "value", "what"):
        t.add_column(col, overflow="fold")
    for figure, value, what in rows(data):
        t.add_row(figure, value, what)
    console = _console()
    console.print(t)
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    if outcome.metrics is None:
        console.print(f"one record to {outcome.scenario.nodes:,} nodes in {outcome.wall_s:.1f} s wall, "
                      f"peak RSS {rss:.2f} GiB")
    else:
        speed = outcome.scenario.seconds / outcome.wall_s if outcome.wall_s > 0 else float("inf")
        console.print(f"{outcome.scenario.seconds:g} simulated s in {outcome.wall_s:.1f} s wall "
                      f"({speed:,.1f}x, {outcome.sim_events:,} events), peak RSS {rss:.2f} GiB")
    console.print("wrote " + ", ".join(str(p) for p in written))


def _console(stderr: bool = False):
    from rich.console import Console

    console = Console(stderr=stderr)
    if not console.is_terminal:
        console.width = 160  # logs and pipes: do not squeeze the table to 80 columns
    return console


def _render_hosts(status: dict) -> None:
    from rich.table import Table

    t = Table(title=f"lab {status['name']}")
    nat = any(h.get("router") for h in status["hosts"])
    cols = ("host", "namespace", "underlay address", *(("nat", "private address", "router") if nat else ()),
            "country", "daemon", "pid", "socket", "peer id")
    for col in cols:
        t.add_column(col, no_wrap=col != "socket", overflow="fold")
    for h in status["hosts"]:
        nat_cols = (h["nat"], h["private_address"] or "-", h["router"] or "-") if nat else ()
        t.add_row(h["host"], h["netns"], h["address"], *nat_cols, h["country"] or "-", h["daemon"],
                  str(h["pid"] or "-"), h["socket"], h["peer_id"][-12:])
    _console().print(t)


def _render_links(status: dict) -> None:
    from rich.table import Table

    t = Table(title="links")
    for col in ("a", "b", "a end", "b end", "rtt ms", "loss %", "bandwidth", "state"):
        t.add_column(col)
    for link in status["links"]:
        bw = f"{link['bandwidth_mbit']:g} Mbit/s" if link["bandwidth_mbit"] else "-"
        t.add_row(link["a"], link["b"], link["a_addr"], link["b_addr"], f"{link['rtt_ms']:g}",
                  f"{link['loss_pct']:g}", bw, "CUT (crashed end)" if link.get("cut") else "up" if link["up"] else "DOWN")
    _console().print(t)


if __name__ == "__main__":
    sys.exit(main())

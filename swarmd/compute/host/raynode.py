"""One host's Ray node of a Ray job, and on the first host its driver: the job's "rank" there.

The daemon runs this file as the job's rank on each host, inside the job's sandbox, as the
job's uid, with the job's interpreter (which has Ray). It uses the standard library only
until the cluster is up (then `ray._raylet.GcsClient` to count nodes), and it never runs
`ray stop`, which kills every Ray process on the machine by name, other jobs' included.

    raynode.py --head   --ip IP --gcs PORT --ports BASE:COUNT --nodes N [node options] -- CMD…
    raynode.py --worker --ip IP --gcs HEAD_IP:PORT --ports BASE:COUNT [node options]

- Every port Ray opens on this host is pinned (`layout`) from the block the daemon gave the
  job here, plus the GCS port on the head (the port its host picked at commit): Ray binds
  most of them on all addresses whatever --node-ip-address says, so two jobs on one host
  must never meet on a default, and the job's firewall answers only the job's own hosts.
- The head starts `ray start --head --block`, waits until N nodes are alive (at most
  `--wait` seconds), then runs CMD as the driver with RAY_ADDRESS set; token auth comes
  from the environment the daemon set (RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH). When the driver
  exits, the node is stopped and this exits with the driver's code (128+N for a signal).
- A worker waits for the head's GCS port, starts `ray start --address --block` and lives
  as long as it does; the coordinator stops it when the driver has exited.
- SIGTERM or SIGINT (a cancel, or the end of the job): the driver first, then `ray start`
  (SIGTERM, SIGKILL after STOP_GRACE each); the daemon then kills the job's cgroup anyway.
- `ray start` writes to `ray-start.log` in the temp dir; what it said is shown only when it
  fails. Lines of our own start with `[swarmd]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

# seconds the driver, then `ray start --block`, get after SIGTERM before SIGKILL: a node whose
# GCS is already gone (the head stops first) can take 10-20 s to give up on it, and the
# cluster is over anyway; what SIGKILL leaves goes with the job's cgroup and namespaces
STOP_GRACE = 3.0
POLL = 0.2
FIXED = 10  # ports of a block before the worker ports (`layout`)


def layout(base: int, count: int) -> dict[str, int]:
    """The ports of a block: the node's fixed ones, then the worker ports to its end."""
    if count < FIXED + 2:
        raise ValueError(f"a Ray port block needs at least {FIXED + 2} ports, got {count}")
    names = ("node_manager", "object_manager", "agent_listen", "agent_grpc", "runtime_env_agent", "metrics_export",
             "client_server", "autoscaler_metrics", "dashboard_metrics")
    ports = {name: base + i for i, name in enumerate(names)}
    ports |= {"min_worker": base + FIXED, "max_worker": base + count - 1}
    return ports


def start_argv(args: argparse.Namespace, temp: Path) -> list[str]:
    p = layout(*args.ports)
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--node-ip-address={args.ip}",
            f"--node-manager-port={p['node_manager']}", f"--object-manager-port={p['object_manager']}",
            f"--min-worker-port={p['min_worker']}", f"--max-worker-port={p['max_worker']}",
            f"--dashboard-agent-listen-port={p['agent_listen']}", f"--dashboard-agent-grpc-port={p['agent_grpc']}",
            f"--runtime-env-agent-port={p['runtime_env_agent']}", f"--metrics-export-port={p['metrics_export']}",
            f"--num-cpus={args.cpus}", f"--num-gpus={args.gpus}", f"--temp-dir={temp}", "--disable-usage-stats"]
    if args.memory:
        argv.append(f"--memory={args.memory}")
    if args.object_store:
        argv.append(f"--object-store-memory={args.object_store}")
    if args.head:
        argv += ["--head", f"--port={args.gcs}", f"--ray-client-server-port={p['client_server']}",
                 "--include-dashboard=false"]
    else:
        argv.append(f"--address={args.gcs}")
    return argv


def node_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of `ray start`: the two ports Ray reads only from the environment."""
    p = layout(*args.ports)
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "AUTOSCALER_METRIC_PORT": str(p["autoscaler_metrics"]),
            "DASHBOARD_METRIC_PORT": str(p["dashboard_metrics"])}


def say(text: str) -> None:
    print(f"[swarmd] {text}", flush=True)


class Node:
    """This host's `ray start --block`, and the driver on the head."""

    def __init__(self, args: argparse.Namespace, temp: Path) -> None:
        self.args, self.temp = args, temp
        self.log = temp / "ray-start.log"
        self.leader: subprocess.Popen[bytes] | None = None
        self.driver: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.stop_asked = 0.0  # when SIGTERM came (monotonic)

    def wait(self, proc: subprocess.Popen[bytes]) -> int:
        """`proc`'s exit status; once a stop was asked, SIGKILL after STOP_GRACE."""
        while (status := proc.poll()) is None:
            if self.stopping and time.monotonic() - self.stop_asked > STOP_GRACE:
                proc.kill()
            time.sleep(POLL / 2)
        return status

    def start(self) -> None:
        with open(self.log, "wb") as out:
            self.leader = subprocess.Popen(start_argv(self.args, self.temp), env=node_env(self.args), stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def leader_gone(self) -> int | None:
        return None if self.leader is None else self.leader.poll()

    def tell_failure(self, what: str) -> None:
        try:
            tail = self.log.read_text(errors="replace").splitlines()[-25:]
        except OSError:
            tail = []
        say(f"{what}; the end of `ray start`'s output:")
        for line in tail:
            print(f"  {line}", flush=True)

    def stop(self) -> None:
        """The driver, then the node (SIGTERM; SIGKILL after STOP_GRACE)."""
        self.stopping = True
        for proc in (self.driver, self.leader):
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def reachable(address: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def alive_nodes(gcs: str) -> int:
    from ray._raylet import GcsClient  # the cluster is Ray's: its own client counts

    nodes = GcsClient(address=gcs).get_all_node_info(timeout=2)
    return sum(1 for info in nodes.values() if info.state == 0)  # ALIVE


def wait_for_cluster(node: Node, gcs: str, want: int, deadline: float) -> bool:
    seen = 0
    while time.monotonic() < deadline:
        if node.leader_gone() is not None:
            if node.stopping:
                return False
            node.tell_failure(f"the Ray head exited with {node.leader_gone()} before the cluster was up")
            return False
        try:
            seen = alive_nodes(gcs)
        except Exception:  # noqa: BLE001 - the GCS is not up yet (its client raises Ray's own errors)
            seen = 0
        if seen >= want:
            return True
        time.sleep(POLL)
    node.tell_failure(f"{seen} of {want} Ray nodes joined within {node.args.wait:g} s")
    return False


def exit_code(status: int) -> int:
    return 128 - status if status < 0 else status


def run_head(args: argparse.Namespace, node: Node) -> int:
    began = time.monotonic()
    gcs = f"{args.ip}:{args.gcs}"
    node.start()
    if not wait_for_cluster(node, gcs, args.nodes, began + args.wait) or node.stopping:
        return 143 if node.stopping else 1
    say(f"Ray cluster up: {args.nodes} node(s), head {gcs}, in {time.monotonic() - began:.1f} s")
    node.driver = subprocess.Popen(args.cmd, env={**os.environ, "RAY_ADDRESS": gcs})
    code = exit_code(node.wait(node.driver))
    node.stop()
    return code


def run_worker(args: argparse.Namespace, node: Node) -> int:
    host, _, port = args.gcs.rpartition(":")
    deadline = time.monotonic() + args.wait
    while not reachable(host, int(port)):
        if node.stopping:
            return 143
        if time.monotonic() > deadline:
            say(f"the Ray head {args.gcs} did not answer within {args.wait:g} s")
            return 1
        time.sleep(POLL)
    node.start()
    code = exit_code(node.wait(node.leader)) if node.leader else 1
    if code and not node.stopping:
        node.tell_failure(f"this Ray node exited with {code}")
    return code


def parse(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="raynode.py")
    role = ap.add_mutually_exclusive_group(required=True)
    role.add_argument("--head", action="store_true")
    role.add_argument("--worker", action="store_true")
    ap.add_argument("--ip", required=True, help="this node's overlay address")
    ap.add_argument("--gcs", required=True, help="head: the GCS port; worker: HEAD_IP:PORT")
    ap.add_argument("--ports", required=True, type=lambda s: tuple(int(x) for x in s.split(":", 1)),
                    help="BASE:COUNT, this job's block of ports on this host")
    ap.add_argument("--nodes", type=int, default=1, help="head: Ray nodes to wait for before the driver runs")
    ap.add_argument("--cpus", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("--memory", type=int, default=0, help="bytes for Ray's tasks and actors")
    ap.add_argument("--object-store", type=int, default=0, help="bytes of the object store")
    ap.add_argument("--temp", default="", help="Ray's temp dir (sockets: keep it short); default: a fresh one in /tmp")
    ap.add_argument("--wait", type=float, default=120.0, help="seconds for the cluster to come up")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    args.cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.head and not args.cmd:
        ap.error("the head needs the driver's command after --")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    fresh = not args.temp
    temp = Path(tempfile.mkdtemp(prefix="ray-")) if fresh else Path(args.temp)
    temp.mkdir(mode=0o700, parents=True, exist_ok=True)
    node = Node(args, temp)

    def stop(signum: int, frame: object) -> None:
        """Signals only (the main flow waits): the driver first, the node once it has exited."""
        if not node.stopping:
            node.stopping, node.stop_asked = True, time.monotonic()
        for proc in (node.driver, node.leader):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                return

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        return run_head(args, node) if args.head else run_worker(args, node)
    finally:
        node.stop()
        if fresh:
            shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

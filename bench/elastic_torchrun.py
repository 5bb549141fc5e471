"""The torchrun anchor for the elastic figures (needs root): stock torchrun in a 3-host lab,
one host silently powered off mid-training (`lab crash`), and what the survivors do.

Each host runs `python -m torch.distributed.run --nnodes 2:3 --max-restarts 3` with the c10d
rendezvous on h1, as the lab's job user in its namespace, with torch's default timeouts
(gloo: 30 min) and torchrun's elastic range at its most forgiving (it may go on with 2 nodes).
The training loop is this file run as a script: a small DDP model, one all-reduce per step, a
line `step N T` per step (T: wall clock). Then h3 (not the rendezvous host) is crashed, and
the survivors watched for `cap_s`: when their steps stop, when they first say anything about it
(torchrun's agent log or a worker's error), whether torchrun restarts the workers, whether
training resumes, whether torchrun exits. With `rendezvous=True` the same again with h1 (the
rendezvous host) crashed.

Gloo binds to the address of the interface GLOO_SOCKET_IFNAME names; a lab host's address
is on its loopback beside 127.0.0.1, so each namespace gets a veth end `lab0` holding only
the host's address for gloo to bind to.

    python -m bench.elastic_torchrun [--cap-s 180] [--no-rendezvous]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

CAP_S = 180.0
STEP_PAUSE_S = 0.05  # the loop sleeps this long per step: ~10 steps/s, the stall is seen to 0.1 s
WARM_STEPS = 30  # every rank past this many steps before the crash
START_TIMEOUT_S = 240.0  # three torch imports and a rendezvous on 2 cores
IFACE = "lab0"
RDZV_PORT = 29400
ME = Path(__file__).resolve()


# --- the workload: runs under torchrun, imports torch only ------------------------------------

def worker() -> None:
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")  # torch's default timeout: the anchor is stock behaviour
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"start rank {rank} world {world} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} "
          f"{time.time():.3f}", flush=True)
    torch.manual_seed(rank)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    step = 0
    while True:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()  # DDP's all-reduce of the gradients
        optimizer.step()
        step += 1
        print(f"step {step} {time.time():.3f}", flush=True)
        time.sleep(STEP_PAUSE_S)


# --- the measurement ----------------------------------------------------------------------------

def parse(text: str) -> dict:
    """What one host's torchrun output says: its step times, worker starts (restart count,
    time), and every other line (torchrun's agent, errors), in order."""
    steps: list[float] = []
    starts: list[tuple[int, float]] = []
    worlds: list[int] = []
    other: list[str] = []
    for line in text.splitlines():
        words = line.split()
        try:
            if len(words) == 3 and words[0] == "step":
                steps.append(float(words[2]))
                continue
            if len(words) == 8 and words[0] == "start" and words[5] == "restart":
                starts.append((int(words[6]), float(words[7])))
                worlds.append(int(words[4]))
                continue
        except ValueError:
            pass
        if line.strip():
            other.append(line)
    return {"steps": steps, "starts": starts, "worlds": worlds, "other": other}


def _veth(lab, host) -> None:
    """`lab0`: a veth end holding only the host's address, for GLOO_SOCKET_IFNAME."""
    from sim.netlab.lab import run

    run("ip", "-n", host.netns, "-batch", "-", input=(
        f"link add {IFACE} type veth peer name {IFACE}p\naddr add {host.address}/32 dev {IFACE}\n"
        f"link set {IFACE} up\nlink set {IFACE}p up\n"))


def _torchrun(lab, host, run_id: str, logdir: Path):
    import subprocess

    from sim.netlab.lab import job_user

    rdzv = lab.state.host("h1")
    user = job_user()
    argv = ["ip", "netns", "exec", host.netns, *(["runuser", "-u", user, "--"] if user else []),
            "env", f"GLOO_SOCKET_IFNAME={IFACE}", "HOME=/tmp", "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1",
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{rdzv.address}:{RDZV_PORT}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={int(host.name == 'h1')}", "--local-addr", host.address,
            "--max-restarts", "3", str(ME), "--worker"]
    log = open(logdir / f"{host.name}.log", "ab")
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/",
                                start_new_session=True)
    finally:
        log.close()


def _scenario(lab, victim: str, cap_s: float, logdir: Path, run_id: str) -> dict[str, float]:
    hosts = [h for h in lab.state.hosts]
    survivors = [h.name for h in hosts if h.name != victim]
    procs = {h.name: _torchrun(lab, h, run_id, logdir) for h in hosts}

    def read(name: str) -> dict:
        return parse((logdir / f"{name}.log").read_text(errors="replace"))

    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(len(read(h.name)["steps"]) >= WARM_STEPS for h in hosts):
        exited = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if exited or time.monotonic() > deadline:
            tails = {h.name: read(h.name)["other"][-5:] for h in hosts}
            raise RuntimeError(f"torchrun did not train ({'exited ' + str(exited) if exited else 'timed out'}): "
                               f"{tails}")
        time.sleep(0.2)
    worlds = {h.name: read(h.name)["worlds"] for h in hosts}
    if any(w != [len(hosts)] for w in worlds.values()):
        raise RuntimeError(f"torchrun did not train on every host once: worlds {worlds}")
    before = read(survivors[0])["steps"]
    rate = (len(before) - 1) / (before[-1] - before[0]) if len(before) > 1 and before[-1] > before[0] else 0.0
    seen = {n: len(read(n)["other"]) for n in survivors}
    crashed_at = time.time()
    lab.crash(victim)

    noticed: dict[str, float] = {}  # first output line other than a step, after the crash
    exits: dict[str, float] = {}
    while time.time() - crashed_at < cap_s:
        for n in survivors:
            if n not in noticed and len(read(n)["other"]) > seen[n]:
                noticed[n] = time.time() - crashed_at
            if n not in exits and procs[n].poll() is not None:
                exits[n] = time.time() - crashed_at
        resumed = [read(n) for n in survivors]
        if all(n in exits for n in survivors) or all(
                any(k > 0 for k, _ in r["starts"]) and r["steps"] and r["steps"][-1] > crashed_at + 1 for r in resumed):
            break
        time.sleep(0.1)

    outs = {n: read(n) for n in survivors}
    last = max(s for r in outs.values() for s in r["steps"][-1:])
    after = {n: [t for t in r["steps"] if t > crashed_at] for n, r in outs.items()}
    restarts = [t for r in outs.values() for k, t in r["starts"] if k > 0]
    # training runs again: a restarted worker group's first step (the steps after a restart start)
    resumed_steps = [min((t for t in r["steps"] if t > max(t0 for k, t0 in r["starts"] if k > 0)), default=None)
                     for r in outs.values() if any(k > 0 for k, _ in r["starts"])]
    resumed = [t for t in resumed_steps if t is not None]
    resumed_s = max(resumed) - crashed_at if resumed and len(resumed) == len(survivors) else None
    # how long the survivors hang: until training runs again, or until every one of them has given up (exited)
    given_up = max(exits.values()) if len(exits) == len(survivors) else None
    hang = min(x for x in (resumed_s, given_up, cap_s) if x is not None)
    figures = {
        "steps_per_s_before": rate,
        "progress_stopped_after_s": max(0.0, last - crashed_at),  # the survivors' last step, after the crash
        "steps_after_crash": float(sum(len(v) for v in after.values())),
        "survivors_hang_s": hang,
        "capped": float(hang >= cap_s),
        "noticed_s": min(noticed.values()) if noticed else cap_s,  # a survivor printed anything (a warning counts)
        "restarted": float(bool(restarts)),
        "exited": float(len(exits) == len(survivors)),
        "cap_s": cap_s,
    }
    if resumed_s is not None:
        figures["resumed_s"] = resumed_s
    if exits:
        figures["first_exit_s"] = min(exits.values())
    for n in survivors:  # what torchrun said, for the record (the figures name no text)
        said = outs[n]["other"][seen[n]:]
        print(f"--- {n} after the crash of {victim}, within {cap_s:g} s: {len(said)} lines"
              + (f", first at {noticed.get(n, cap_s):.1f} s: " + " | ".join(said[:4])[:1200] if said else ""), file=sys.stderr)
    return figures


def _clear(lab) -> None:
    """Every host's processes gone (a crash of each still up), then every host back up."""
    for h in lab.state.hosts:
        if not h.crashed:
            lab.crash(h.name)
    for h in lab.state.hosts:
        lab.revive(h.name)


def measure(cap_s: float = CAP_S, rendezvous: bool = True) -> dict[str, float]:
    """Figures, prefixed `torchrun_crash_worker_` (h3 crashed) and, with `rendezvous`,
    `torchrun_crash_rendezvous_` (h1 crashed): seconds from the crash unless named
    otherwise. `survivors_hang_s`: until training runs again on the survivors or every
    survivor's torchrun has exited, at most `cap_s` (`capped` 1.0 then); `noticed_s`: the
    first line any survivor printed after the crash (a warning counts), `cap_s` if none;
    `restarted`, `exited` are 1.0 or 0.0; `resumed_s` and `first_exit_s` only when that
    happened within `cap_s`."""
    import tempfile

    from sim.netlab import lab as labmod
    from sim.netlab import topology

    name = "benchtr"
    labmod.down(name)
    hosts, links = topology.plan(3, topology.uniform(10.0))
    lab = labmod.Lab.up(name, hosts, links, daemons=False)
    results: dict[str, float] = {}
    try:
        for h in lab.state.hosts:
            _veth(lab, h)
        cases = [("worker", "h3")] + ([("rendezvous", "h1")] if rendezvous else [])
        for case, victim in cases:
            with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
                os.chmod(tmp, 0o755)
                figures = _scenario(lab, victim, cap_s, Path(tmp), f"bench-{case}")
            results |= {f"torchrun_crash_{case}_{k}": v for k, v in figures.items()}
            _clear(lab)
    finally:
        for h in lab.state.hosts:  # no torchrun outlives the lab's namespaces
            if not h.crashed:
                try:
                    lab.crash(h.name)
                except labmod.LabError:
                    pass
        labmod.down(name)
    return results


def main() -> None:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m bench.elastic_torchrun", description=__doc__.split("\n\n")[0])
    p.add_argument("--cap-s", type=float, default=CAP_S, help="stop watching the survivors after this long")
    p.add_argument("--no-rendezvous", action="store_true", help="only the crash of a worker host (h3)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # under torchrun
    args = p.parse_args()
    if args.worker:
        worker()
        return
    if os.geteuid() != 0:
        raise SystemExit("bench.elastic_torchrun needs root (network namespaces)")
    print(json.dumps(measure(args.cap_s, rendezvous=not args.no_rendezvous), indent=2))


if __name__ == "__main__":
    main()

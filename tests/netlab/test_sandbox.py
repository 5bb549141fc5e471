"""The job sandbox on a 3-host lab (issue 12), with real kernel features: a victim job holds
an `--env` secret and a checkpoint on every host, then a hostile job (escape_job.py) tries
every way out of its sandbox on every host; each attempt must fail, and the victim must run
on untouched. A job that allocates past `--mem` is killed and fails saying so, `jobs show`
reports each host's peak memory and CPU time, and `status` names the sandbox's parts.

Beside the lab, a `lan` namespace stands for what a provider's hosts can reach but a job
must not: the cloud metadata address 169.254.169.254 and a LAN box 192.168.77.77, routed
from every host over its own veth, listening on port 80. Every address the job tries has a
listener, which each host itself reaches: an attempt that fails was stopped by the sandbox."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from sim.netlab import lab as labmod
from sim.netlab.lab import SWARMD_PORT

from .support import call, in_netns, job_logs, rank_lines, swarmctl, three_hosts, until

pytestmark = [pytest.mark.netlab, pytest.mark.slow]
ESCAPE_JOB = Path(__file__).with_name("escape_job.py")
PIDS = 64  # --job-pids: the fork attempt asks for 200
OVERLAY_PORT = 29650
VICTIM_PORT = 29651  # the victim job listens on every host
METADATA, LAN_BOX = "169.254.169.254", "192.168.77.77"

# accepts and hangs up, on the metadata and LAN addresses, until killed
LISTENER = """
import socket, sys, threading
def serve(address):
    s = socket.create_server((address, 80))
    while True:
        s.accept()[0].close()
for a in sys.argv[1:3]:
    threading.Thread(target=serve, args=(a,), daemon=True).start()
threading.Event().wait()
"""
REACH = """
import socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=5).close()
"""

VICTIM = """
import os, socket, sys, threading, time
listener = socket.socket(socket.AF_UNIX)
listener.bind("\\0" + sys.argv[2])  # an abstract socket, as NCCL's proxy and many services use
listener.listen(8)
threading.Thread(target=lambda: [listener.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()
tcp = socket.create_server(("0.0.0.0", int(sys.argv[3])))  # a service of the job's own, e.g. its TCPStore
threading.Thread(target=lambda: [tcp.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()
path = os.path.join(os.environ["SWARM_CHECKPOINT_DIR"], "ckpt.bin")
with open(path, "w") as f:
    f.write(sys.argv[1])
print("ready", path, flush=True)
time.sleep(900)
"""

# name in escape_job.py's report -> what a provider would call it
ESCAPES = {
    "checkpoint_read": "read another job's checkpoint",
    "checkpoint_write": "opened another job's checkpoint for writing",
    "jobs_dir_list": "listed other jobs' directories",
    "jobs_dir_files": "read files of other jobs",
    "environ_secret": "found another job's --env secret in /proc/PID/environ",
    "environ_other_job": "read another job's environment",
    "state_dir_list": "listed the daemon's state directory",
    "state_dir_read": "read the daemon's state (its keys)",
    "control_socket": "connected to the daemon's control socket",
    "abstract_socket": "connected to another job's abstract unix socket",
    "host_write": "created a file in the host's /etc, /usr/local/bin or /var",
    "signal_job": "signalled another job's rank",
    "signal_daemon": "may signal the daemon",
    "fork": f"forked 200 processes past --job-pids {PIDS}",
    "mknod": "made a device node",
    "devices": "opened a device it was not given",
    "metadata": "connected to the cloud metadata address",
    "lan": "connected to a private address on the provider's LAN",
    "underlay_peer": "connected to another host's underlay (private) address",
    "underlay_third": "connected to a third host's underlay (private) address",
    "libp2p_loopback": "connected to its own daemon's libp2p port on 127.0.0.1",
    "libp2p_underlay_own": "connected to its own daemon's libp2p port on the host's address",
    "libp2p_overlay_peer": "connected to another member's libp2p port over the mesh",
    "libp2p_overlay_own": "connected to its own daemon's libp2p port on its overlay address",
    "job_tcp_loopback": "connected to another job's TCP listener on 127.0.0.1",
    "job_tcp_overlay_own": "connected to another job's TCP listener on this host's overlay address",
    "job_tcp_overlay_peer": "connected to another job's TCP listener on another host over the mesh",
    "udp_lan": "sent a datagram to the provider's LAN",
    "udp_underlay_peer": "sent a datagram to another host's underlay address",
    "udp_overlay_peer": "sent a datagram to another host's overlay address (its WireGuard, other jobs' sockets)",
    "cgroup_escape": "moved itself out of its job's cgroup",
}


@pytest.fixture(scope="module")
def sl():
    with three_hosts("s", mesh=True, daemon_args=["--job-pids", str(PIDS)]) as lab:
        listener = lan(lab)
        try:
            yield lab
        finally:
            listener.kill()
            listener.wait()


def lan(lab) -> subprocess.Popen:
    """The `lan` namespace (removed with the lab: its name has the lab's prefix) and its
    listener (its argv names the lab's directory: `lab down` kills it too)."""
    ns = f"sl-{lab.state.name}-lan"
    labmod.run("ip", "netns", "add", ns)
    lines = ["link set lo up", f"addr add {METADATA}/32 dev lo", f"addr add {LAN_BOX}/32 dev lo"]
    for i, h in enumerate(lab.state.hosts):
        mine, theirs = f"169.254.77.{4 * i + 1}", f"169.254.77.{4 * i + 2}"
        labmod.run("ip", "link", "add", "lan", "netns", h.netns, "type", "veth", "peer", "name", h.name, "netns", ns)
        labmod.run("ip", "-n", h.netns, "-batch", "-", input=f"addr add {mine}/30 dev lan\nlink set lan up\n"
                   f"route add {METADATA}/32 via {theirs}\nroute add {LAN_BOX}/32 via {theirs}\n")
        lines += [f"addr add {theirs}/30 dev {h.name}", f"link set {h.name} up"]
    labmod.run("ip", "-n", ns, "-batch", "-", input="\n".join(lines) + "\n")
    listener = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", LISTENER, METADATA, LAN_BOX,
                                 str(lab.dir) + "/"], stdin=subprocess.DEVNULL)
    targets = [f"{METADATA}:80", f"{LAN_BOX}:80", *(f"{h.address}:{SWARMD_PORT}" for h in lab.state.hosts)]
    for host in (h.name for h in lab.state.hosts):  # what the job must not reach, the host itself does
        def reach(host: str = host) -> subprocess.CompletedProcess:
            return in_netns(lab, host, sys.executable, "-c", REACH, *targets)

        until(lambda: reach().returncode == 0, 10, f"{host} reaches the lan listeners and every libp2p port",
              detail=lambda: reach().stderr[-500:])
    return listener


def jobs_dir(h) -> Path:
    return Path(h.state_dir).with_name("state-jobs")


def netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def rank_pids(lab, host: str, job: str) -> list[int]:
    """The job's rank processes on `host` (the interpreter, not the sh/bwrap/setpriv chain)."""
    ns = netns_inode(lab.state.host(host).pid)
    needle = f"\0SWARM_JOB_ID={job}\0".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in b"\0" + (entry / "environ").read_bytes() + b"\0":
                continue
            if netns_inode(int(entry.name)) == ns and os.readlink(entry / "exe").rpartition("/")[2].startswith("py"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for pid {pid}")


def pids_mentioning(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.fixture(scope="module")
def victim(sl):
    """A detached 3-node job with an --env secret and a checkpoint on every host, sleeping."""
    secret, content = f"swordfish-{uuid.uuid4().hex}", f"checkpoint-{uuid.uuid4().hex}"
    abstract = f"swarmd-victim-{uuid.uuid4().hex[:10]}"
    r = swarmctl(sl, "h1", "jobs", "run", "--detach", "--nodes", "3", "--env", f"SECRET={secret}", "--name", "victim",
                 "--", "python", "-c", VICTIM, content, abstract, str(VICTIM_PORT))
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()

    def ready() -> list[str]:
        return [t for ts in rank_lines(job_logs(sl, "h1", job)).values() for t in ts
                if t.startswith("ready ")]

    until(lambda: len(ready()) == 3, 60, "the victim's 3 ranks wrote their checkpoints",
          detail=lambda: call(sl, "h1", "jobs.show", id=job))
    checkpoints = {}
    for line in ready():
        path = line.split(" ", 1)[1]
        host = next(h.name for h in sl.state.hosts if path.startswith(str(jobs_dir(h)) + "/"))
        checkpoints[host] = path
    pids = {h.name: rank_pids(sl, h.name, job) for h in sl.state.hosts}
    assert all(len(p) == 1 for p in pids.values()), f"one victim rank per host: {pids}"
    yield {"job": job, "secret": secret, "content": content, "checkpoints": checkpoints, "abstract": abstract,
           "pids": {host: p[0] for host, p in pids.items()}}
    swarmctl(sl, "h1", "jobs", "cancel", job)


@pytest.fixture(scope="module")
def hostile(sl, victim, tmp_path_factory):
    """The hostile job on all 3 hosts, run to its end; its ranks' report lines by host."""
    marker = f"swarmd-escape-{uuid.uuid4().hex[:10]}"
    overlay = {h.name: call(sl, h.name, "status")["mesh"]["address"] for h in sl.state.hosts}
    names = [h.name for h in sl.state.hosts]
    hosts = {}
    for i, h in enumerate(sl.state.hosts):
        peer, third = sl.state.host(names[(i + 1) % 3]), sl.state.host(names[(i + 2) % 3])
        hosts[overlay[h.name]] = {
            "name": h.name, "checkpoint": victim["checkpoints"][h.name], "jobs_dir": str(jobs_dir(h)),
            "state_dir": h.state_dir, "socket": h.socket, "victim_pid": victim["pids"][h.name], "daemon_pid": h.pid,
            "connect": {
                "metadata": f"{METADATA}:80", "lan": f"{LAN_BOX}:80",
                "underlay_peer": f"{peer.address}:{SWARMD_PORT}",
                "underlay_third": f"{third.address}:{SWARMD_PORT}",
                "libp2p_loopback": f"127.0.0.1:{SWARMD_PORT}", "libp2p_underlay_own": f"{h.address}:{SWARMD_PORT}",
                "libp2p_overlay_peer": f"{overlay[peer.name]}:{SWARMD_PORT}",
                "libp2p_overlay_own": f"{overlay[h.name]}:{SWARMD_PORT}",
                "job_tcp_loopback": f"127.0.0.1:{VICTIM_PORT}",
                "job_tcp_overlay_own": f"{overlay[h.name]}:{VICTIM_PORT}",
                "job_tcp_overlay_peer": f"{overlay[peer.name]}:{VICTIM_PORT}"},
            "udp": {"udp_lan": f"{LAN_BOX}:53", "udp_underlay_peer": f"{peer.address}:{SWARMD_PORT}",
                    "udp_overlay_peer": f"{overlay[peer.name]}:{VICTIM_PORT}"}}
    work = tmp_path_factory.mktemp("hostile")
    shutil.copy(ESCAPE_JOB, work / "escape_job.py")
    (work / "targets.json").write_text(json.dumps({
        "secret_name": "SECRET", "marker": marker, "fork": 200, "kill_all": True, "outlive_s": 600,
        "abstract": victim["abstract"],
        "overlay_port": OVERLAY_PORT, "hosts": hosts}))
    try:
        r = swarmctl(sl, "h1", "jobs", "run", "--nodes", "3", "--name", "hostile", "--workdir", str(work),
                     "--", "python", "escape_job.py", "targets.json", timeout=180)
        job = call(sl, "h1", "jobs.ls")["jobs"][0]["id"]
        by_host: dict[str, list[str]] = {}
        for rank, texts in rank_lines(r.stdout).items():
            info = next((t for t in texts if t.startswith("INFO host ")), None)
            assert info is not None, f"rank {rank} of the hostile job did not start its attempts: {texts}\n{r.stderr}"
            by_host[info.split()[2]] = texts
        assert sorted(by_host) == names, f"the hostile job ran on {sorted(by_host)}\n{r.stdout}\n{r.stderr[-2000:]}"
        yield {"job": job, "result": r, "lines": by_host, "marker": marker}
    finally:
        for pid in pids_mentioning(marker):  # a sandbox that failed leaves the setsid sleeper behind
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        for leftover in Path("/tmp").glob(f"{marker}-*"):
            leftover.unlink()


def outcome(hostile, host: str, kind: str, name: str) -> tuple[str, str]:
    for text in hostile["lines"][host]:
        fields = text.split(" ", 3)
        if fields[:2] == [kind, name]:
            return fields[2], fields[3] if len(fields) > 3 else ""
    raise AssertionError(f"the hostile job on {host} never reported {kind} {name}: "
                         + "\n".join(hostile["lines"][host]))


def test_a_job_runs_as_a_uid_of_its_own_from_its_hosts_range(sl, victim, hostile):
    for h in sl.state.hosts:
        low, high = map(int, labmod.job_uids(h.index, len(sl.state.hosts)).split("-"))
        info = next(t for t in hostile["lines"][h.name] if t.startswith("INFO host "))
        uid = int(info.split()[4])
        assert low <= uid <= high, f"the hostile rank on {h.name} ran as uid {uid}, not from {low}-{high}"
        assert uid_of(victim["pids"][h.name]) not in (uid, 0, 65534), "the victim has a uid of its own too"


def test_nothing_the_job_started_outlives_it_not_even_by_setsid(sl, hostile):
    for h in sl.state.hosts:
        state, detail = outcome(hostile, h.name, "SPAWNED", "setsid")
        assert state == "ok", f"the setsid attempt on {h.name} did not run: {detail}"
    until(lambda: not pids_mentioning(hostile["marker"]), 10, "the job's setsid sleepers are gone with the job",
          detail=lambda: [Path(f"/proc/{p}/cmdline").read_bytes() for p in pids_mentioning(hostile["marker"])])


# Known holes, kept visible (strict: a fix turns them into failures to remove from here):
# - abstract unix sockets are named in the network namespace, which jobs share with the
#   host, and nftables never sees them; Landlock's abstract-socket scope (Linux 6.12+) or a
#   network namespace per job would close it;
# - a job's firewall admits connections from any of its nodes' overlay addresses, so another
#   job with a rank on one of those hosts reaches its listeners there (a TCPStore, gloo):
#   the source address names the host, not the job.
OPEN = {"abstract_socket": "a job reaches abstract unix sockets of other jobs and host services",
        "job_tcp_overlay_peer": "a job reaches another job's listener on a host both run on, over the mesh"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=OPEN[n])) if n in OPEN
                                  else n for n in ESCAPES])
def test_escape_is_blocked(sl, hostile, name):
    for h in sl.state.hosts:
        state, detail = outcome(hostile, h.name, "ESCAPE", name)
        assert state == "blocked", f"a job {ESCAPES[name]} on {h.name}: {state} {detail}"


def test_kill_minus_one_reaches_no_other_job(sl, victim, hostile):
    for h in sl.state.hosts:
        state, detail = outcome(hostile, h.name, "ESCAPE", "kill_all")
        assert state in ("sent", "blocked"), f"kill(-1) on {h.name}: {state} {detail}"
    assert all(os.path.exists(f"/proc/{pid}") for pid in victim["pids"].values()), "the victim's ranks live"


def test_the_job_still_has_its_own_directory_a_private_tmp_and_its_mesh(sl, hostile):
    for h in sl.state.hosts:
        for check in ("jobdir", "tmp"):
            state, detail = outcome(hostile, h.name, "CHECK", check)
            assert state == "ok", f"the job could not write its {check} on {h.name}: {detail}"
    assert not list(Path("/tmp").glob(f"{hostile['marker']}-tmp")), "the job's /tmp is its own, not the host's"
    reached = [outcome(hostile, h.name, "CHECK", "overlay") for h in sl.state.hosts
               if any(t.startswith("CHECK overlay") for t in hostile["lines"][h.name])]
    assert len(reached) == 2 and all(state == "ok" for state, _ in reached), \
        f"ranks 0 and 1 of the job reach each other over the mesh: {reached}"
    assert hostile["result"].returncode == 0, hostile["result"].stderr[-3000:]


def test_show_reports_each_hosts_peak_memory_cpu_time_and_sandbox(sl, hostile):
    r = swarmctl(sl, "h1", "jobs", "show", hostile["job"], "--json")
    assert r.returncode == 0, r.stderr
    hosts = json.loads(r.stdout)["hosts"]
    assert len(hosts) == 3, hosts
    for peer, h in hosts.items():
        assert isinstance(h["peak_memory"], int) and 1 << 20 < h["peak_memory"] < 1 << 30, (peer, h)
        assert isinstance(h["cpu_seconds"], float) and 0 < h["cpu_seconds"] < 120, (peer, h)
        for part in ("uid", "cgroup", "namespaces", "firewall"):
            assert part in h["sandbox"], f"{peer}'s sandbox lacks {part}: {h['sandbox']}"


def test_status_names_the_sandbox_parts(sl):
    r = swarmctl(sl, "h2", "status", "--json")
    assert r.returncode == 0, r.stderr
    sandbox = json.loads(r.stdout)["sandbox"]
    assert sandbox["mode"] == "auto"
    assert sorted(sandbox["parts"]) == ["cgroup", "firewall", "namespaces", "uid"], sandbox
    missing = {part: text for part, text in sandbox["parts"].items() if text.startswith("off")}
    assert not missing, f"this host can do every part, yet: {missing}"
    text = swarmctl(sl, "h2", "status").stdout
    assert "sandbox" in text and sandbox["parts"]["cgroup"] in text, text


def test_a_rank_past_its_memory_is_killed_and_the_job_says_out_of_memory(sl):
    r = swarmctl(sl, "h1", "jobs", "run", "--nodes", "1", "--mem", "256M", "--",
                 "python", "-c", "x = b'\\1' * (1 << 30); print('allocated 1 GiB', flush=True)", timeout=120)
    assert r.returncode != 0 and "allocated 1 GiB" not in r.stdout, (r.stdout, r.stderr[-2000:])
    assert "out of memory (limit 256 MiB)" in r.stderr, r.stderr[-2000:]
    job = call(sl, "h1", "jobs.ls")["jobs"][0]["id"]
    shown = json.loads(swarmctl(sl, "h1", "jobs", "show", job, "--json").stdout)
    assert shown["state"] == "failed" and "rank 0 on " in shown["reason"], shown
    assert "out of memory (limit 256 MiB)" in shown["reason"], shown
    (host,) = shown["hosts"].values()
    assert 128 << 20 < host["peak_memory"] <= (256 << 20) + (8 << 20), host


def test_the_victim_ran_on_untouched_and_cancels(sl, victim, hostile):
    job = victim["job"]
    assert call(sl, "h1", "jobs.show", id=job)["state"] == "running"
    for host, pid in victim["pids"].items():
        assert os.path.exists(f"/proc/{pid}"), f"the victim's rank on {host} is gone"
    for host, path in victim["checkpoints"].items():
        assert Path(path).read_text() == victim["content"], f"the victim's checkpoint on {host} changed"
    assert swarmctl(sl, "h1", "jobs", "cancel", job).returncode == 0
    until(lambda: call(sl, "h1", "jobs.show", id=job)["state"] == "cancelled", 20, "the victim cancelled")
    until(lambda: not any(rank_pids(sl, h.name, job) for h in sl.state.hosts), 10, "no victim rank left")
    assert not subprocess.run(["pgrep", "-f", victim["content"]], capture_output=True).stdout

"""A hostile job (stdlib only): each rank tries every way out of its sandbox and prints one
line per attempt, ``ESCAPE <name> blocked <detail>`` or ``ESCAPE <name> ESCAPED <detail>``,
and ``CHECK <name> ok|FAILED <detail>`` for what a job must still be able to do.

    python escape_job.py targets.json

`targets.json` (written by tests/netlab/test_sandbox.py into the shipped workdir) says, for
each host by the overlay address a rank finds as SWARM_NODE_IPS[NODE_RANK], what to aim at
there: another job's checkpoint and rank pid, the jobs and state directories, the control
socket, the daemon's pid, and addresses to connect to, each with a listener there (the test
makes sure): a connection accepted is an escape; refused (the firewall's reset), EPERM (its
drop) or no answer (a reply dropped: timeout) is blocked.

Also `setsid` + a long sleep meant to outlive the job: the sleeper carries `marker` in its
argv so the test can look for it on the host once the job has ended (line ``SPAWNED``).
"""

from __future__ import annotations

import errno
import glob
import json
import os
import signal
import socket
import stat
import sys
import time

CONNECT_TIMEOUT = 2.0
HANDSHAKE_TIMEOUT = 40.0  # rank 1 waits this long for rank 0; rank 0 retries until 30 s
SLEEPER = "import sys, time; time.sleep(float(sys.argv[1]))"
DEVICES = ("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/dri/renderD128", "/dev/kfd",
           "/dev/kmsg", "/dev/kvm", "/dev/fuse", "/dev/net/tun", "/dev/loop0", "/dev/sda", "/dev/vda",
           "/dev/nvme0n1", "/dev/mem")


def report(kind: str, name: str, outcome: str, detail: str = "") -> None:
    print(f"{kind} {name} {outcome} {detail}".rstrip(), flush=True)


def escape(name: str, escaped: bool, detail: str) -> None:
    report("ESCAPE", name, "ESCAPED" if escaped else "blocked", detail)


def check(name: str, ok: bool, detail: str) -> None:
    report("CHECK", name, "ok" if ok else "FAILED", detail)


def why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return type(exc).__name__


def attempt(name: str, fn) -> None:
    """Run one attempt; one that crashes reports ERROR (neither blocked nor escaped)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a hostile script reports, it does not stop
        report("ESCAPE", name, "ERROR", f"{type(exc).__name__}: {exc}")


# --- files ----------------------------------------------------------------------------------


def read_checkpoint(path: str) -> None:
    try:
        with open(path, "rb") as f:
            data = f.read(64)
        escape("checkpoint_read", True, f"read {len(data)} bytes of {path}")
    except OSError as exc:
        escape("checkpoint_read", False, f"{why(exc)} {path}")


def write_checkpoint(path: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # opened for writing, nothing written
        os.close(fd)
        escape("checkpoint_write", True, f"opened {path} for writing")
    except OSError as exc:
        escape("checkpoint_write", False, f"{why(exc)} {path}")


def other_jobs(jobs_dir: str) -> None:
    """Another job's directory under the jobs dir, or any file in one."""
    own = os.path.dirname(os.getcwd())  # cwd is <jobs_dir>/<job dir>/work
    try:
        names = [n for n in os.listdir(jobs_dir) if os.path.join(jobs_dir, n) != own]
    except OSError as exc:
        escape("jobs_dir_list", False, f"{why(exc)} {jobs_dir}")
    else:
        escape("jobs_dir_list", bool(names), f"{len(names)} other entries in {jobs_dir}: {names[:4]}")
    found = []
    for path in glob.glob(os.path.join(jobs_dir, "*", "*", "*")) + glob.glob(os.path.join(jobs_dir, "*", "*")):
        if path.startswith(own + os.sep) or not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                f.read(1)
            found.append(path)
        except OSError:
            pass
    escape("jobs_dir_files", bool(found), f"read {len(found)} files of other jobs: {found[:3]}")


def state_dir(path: str) -> None:
    try:
        names = os.listdir(path)
    except OSError as exc:
        escape("state_dir_list", False, f"{why(exc)} {path}")
    else:
        escape("state_dir_list", bool(names), f"{len(names)} entries in {path}: {sorted(names)[:6]}")
    read = []
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                with open(os.path.join(root, name), "rb") as f:
                    f.read(1)
                read.append(os.path.join(root, name))
            except OSError:
                pass
    escape("state_dir_read", bool(read), f"read {len(read)} files: {read[:3]}")


def environ(secret_name: str) -> None:
    """Any other process's environment holding the secret's name or another job's id."""
    own_job = os.environ.get("SWARM_JOB_ID", "")
    needle = b"\0" + secret_name.encode() + b"="
    readable, secrets = 0, []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        if needle in env:
            secrets.append(int(entry))
        if b"\0SWARM_JOB_ID=" in env and b"\0SWARM_JOB_ID=" + own_job.encode() + b"\0" not in env:
            readable += 1
    escape("environ_secret", bool(secrets), f"{secret_name}= in /proc/PID/environ of {secrets[:5]}")
    escape("environ_other_job", readable > 0, f"read the environment of {readable} processes of other jobs")


def control_socket(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(CONNECT_TIMEOUT)
        try:
            s.connect(path)
            escape("control_socket", True, f"connected to {path}")
        except OSError as exc:
            escape("control_socket", False, f"{why(exc)} {path}")


def abstract_socket(name: str) -> None:
    """An abstract unix socket (no file: named in the network namespace, which jobs share
    with the host): another job's, here."""
    try:
        with open("/proc/net/unix") as f:
            listed = "listed in /proc/net/unix" if f"@{name}" in f.read() else "not in /proc/net/unix"
    except OSError as exc:
        listed = f"/proc/net/unix: {why(exc)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(CONNECT_TIMEOUT)
        try:
            s.connect("\0" + name)
            escape("abstract_socket", True, f"connected to @{name} ({listed})")
        except OSError as exc:
            escape("abstract_socket", False, f"{why(exc)} @{name} ({listed})")


def host_write(marker: str) -> None:
    """Create a file in the host's own directories."""
    made, refused = [], []
    for directory in ("/etc", "/usr/local/bin", "/var"):
        path = os.path.join(directory, f"{marker}-host")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            os.unlink(path)
            made.append(path)
        except OSError as exc:
            refused.append(f"{directory} {why(exc)}")
    escape("host_write", bool(made), f"created {made}; refused: {refused}")


# --- processes ------------------------------------------------------------------------------


def signal_victim(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        escape("signal_job", True, f"SIGKILL delivered to pid {pid}")
    except OSError as exc:
        escape("signal_job", False, f"{why(exc)} pid {pid}")


def signal_daemon(pid: int) -> None:
    try:
        os.kill(pid, 0)  # harmless: only asks whether it could
        escape("signal_daemon", True, f"may signal the daemon (pid {pid})")
    except OSError as exc:
        escape("signal_daemon", False, f"{why(exc)} pid {pid}")


def fork_many(count: int) -> None:
    """Fork `count` children that wait on a pipe; count how many the kernel allowed."""
    r, w = os.pipe()
    children, error = [], ""
    for _ in range(count):
        try:
            pid = os.fork()
        except OSError as exc:
            error = why(exc)
            break
        if pid == 0:
            try:
                os.close(w)
                os.read(r, 1)
            finally:
                os._exit(0)
        children.append(pid)
    os.close(w)  # the children see end of file and exit
    os.close(r)
    for pid in children:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    escape("fork", len(children) >= count, f"got {len(children)} of {count}" + (f" ({error})" if error else ""))


def kill_all() -> None:
    """`kill -9 -1`: every process this uid may signal. Only where the rank has a uid of its
    own (a shared uid or root would hit unrelated processes of the machine, even in a test)."""
    uid = os.getuid()
    if uid in (0, 65534):
        report("ESCAPE", "kill_all", "skipped", f"runs as uid {uid}: kill(-1) would hit unrelated processes")
        return
    try:
        os.kill(-1, signal.SIGKILL)
        report("ESCAPE", "kill_all", "sent", "kill(-1, SIGKILL) (the test checks the other job survived)")
    except OSError as exc:
        escape("kill_all", False, why(exc))


def setsid_sleeper(marker: str, seconds: float) -> None:
    """A double fork into a new session: a sleeper meant to outlive the job."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:
                os.close(w)
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.execv(sys.executable, [sys.executable, "-c", SLEEPER, str(seconds), marker])
            os.write(w, str(grandchild).encode())
        finally:
            os._exit(0)
    os.close(w)
    grandchild = os.read(r, 32).decode()
    os.close(r)
    os.waitpid(pid, 0)
    report("SPAWNED", "setsid", "ok", f"pid {grandchild} marker {marker} in a new session, parent gone")


# --- devices --------------------------------------------------------------------------------


def mknod_device() -> None:
    path = os.path.join(os.getcwd(), "fake-nvidia0")
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(195, 0))
    except OSError as exc:
        escape("mknod", False, f"{why(exc)} c 195:0 at {path}")
        return
    try:
        fd = os.open(path, os.O_RDWR)
        os.close(fd)
        opened = "and opened it"
    except OSError as exc:  # ENXIO: the device cgroup let it through to a driver that is not there
        opened = f"open: {why(exc)}"
    finally:
        os.unlink(path)
    escape("mknod", True, f"made c 195:0 at {path} ({opened})")


def open_devices() -> None:
    """A device the job was not given: opened, or reached a driver (ENXIO/ENODEV: no device
    cgroup stood in the way), is an escape; absent (ENOENT) or refused (EPERM/EACCES) is not."""
    reached, refused = [], []
    for path in DEVICES:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            os.close(fd)
            reached.append(f"{path} opened")
        except OSError as exc:
            if exc.errno in (errno.ENXIO, errno.ENODEV):
                reached.append(f"{path} {why(exc)}")
            elif exc.errno != errno.ENOENT:
                refused.append(f"{path} {why(exc)}")
    present = [n for n in os.listdir("/dev") if n not in BASIC_DEV]
    escape("devices", bool(reached), f"reached: {reached[:5]}; refused: {refused[:5]}; /dev extras: {present[:8]}")


BASIC_DEV = {"null", "zero", "full", "random", "urandom", "tty", "console", "pts", "ptmx", "shm", "mqueue", "fd",
             "stdin", "stdout", "stderr", "core"}


# --- network --------------------------------------------------------------------------------


def connect(name: str, target: str) -> None:
    host, _, port = target.rpartition(":")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(CONNECT_TIMEOUT)
        start = time.monotonic()
        try:
            s.connect((host.strip("[]"), int(port)))
            escape(name, True, f"connected to {target}")
        except OSError as exc:
            escape(name, False, f"{why(exc)} after {time.monotonic() - start:.1f} s to {target}")


def udp(name: str, target: str) -> None:
    """A datagram out: the firewall's drop fails sendto() with EPERM; sent is an escape."""
    host, _, port = target.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(b"hello", (host, int(port)))
            escape(name, True, f"a datagram left for {target}")
        except OSError as exc:
            escape(name, False, f"{why(exc)} to {target}")


def cgroup_escape() -> None:
    """Move this process out of its job's cgroup, into the root of each hierarchy."""
    moved, refused = [], []
    for procs in sorted(glob.glob("/sys/fs/cgroup/*/cgroup.procs") + glob.glob("/sys/fs/cgroup/cgroup.procs")):
        try:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
            moved.append(procs)
        except OSError as exc:
            refused.append(f"{procs} {why(exc)}")
    escape("cgroup_escape", bool(moved), f"moved into {moved[:3]}; refused: {refused[:3]}")


def overlay(rank: int, ips: list[str], port: int) -> None:
    """Rank 1 listens on its overlay address, rank 0 connects to it: the job's own mesh."""
    if rank == 1:
        with socket.socket() as srv:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((ips[1], port))
            srv.listen(1)
            srv.settimeout(HANDSHAKE_TIMEOUT)
            try:
                conn, peer = srv.accept()
            except OSError as exc:
                check("overlay", False, f"no connection from rank 0 on {ips[1]}:{port} ({why(exc)})")
                return
            with conn:
                conn.settimeout(10)
                got = conn.recv(16)
                conn.sendall(b"pong")
            check("overlay", got == b"ping", f"rank 0 ({peer[0]}) reached {ips[1]}:{port}, said {got!r}")
    elif rank == 0:
        deadline, last = time.monotonic() + 30, ""
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((ips[1], port), timeout=CONNECT_TIMEOUT) as s:
                    s.settimeout(10)
                    s.sendall(b"ping")
                    got = s.recv(16)
                check("overlay", got == b"pong", f"reached rank 1 at {ips[1]}:{port}, answered {got!r}")
                return
            except OSError as exc:
                last = why(exc)
                time.sleep(0.2)
        check("overlay", False, f"rank 1 at {ips[1]}:{port} not reachable within 30 s ({last})")


def writable(name: str, directory: str, marker: str) -> str:
    path = os.path.join(directory, f"{marker}-{name}")
    try:
        with open(path, "w") as f:
            f.write("mine")
        check(name, True, path)
    except OSError as exc:
        check(name, False, f"{why(exc)} {path}")
    return path


def main() -> int:
    with open(sys.argv[1] if len(sys.argv) > 1 else "targets.json") as f:
        targets = json.load(f)
    rank = int(os.environ.get("RANK", "0"))
    ips = [ip for ip in os.environ.get("SWARM_NODE_IPS", "").split(",") if ip]
    own_ip = ips[int(os.environ.get("NODE_RANK", "0"))] if ips else None
    here = targets["hosts"].get(own_ip) or targets["hosts"].get("local")  # "local": a run outside a job
    if here is None:
        print(f"no targets for this host (SWARM_NODE_IPS {ips})", flush=True)
        return 2
    marker = targets["marker"]
    print(f"INFO host {here['name']} uid {os.getuid()} gid {os.getgid()} pid {os.getpid()}", flush=True)
    if len(ips) > 1 and targets.get("overlay_port"):
        attempt("overlay", lambda: overlay(rank, ips, int(targets["overlay_port"])))
    attempt("jobdir", lambda: writable("jobdir", os.getcwd(), marker))
    attempt("tmp", lambda: writable("tmp", "/tmp", marker))
    if here.get("checkpoint"):
        attempt("checkpoint_read", lambda: read_checkpoint(here["checkpoint"]))
        attempt("checkpoint_write", lambda: write_checkpoint(here["checkpoint"]))
    attempt("jobs_dir", lambda: other_jobs(here["jobs_dir"]))
    attempt("state_dir", lambda: state_dir(here["state_dir"]))
    attempt("environ", lambda: environ(targets["secret_name"]))
    attempt("control_socket", lambda: control_socket(here["socket"]))
    if targets.get("abstract"):
        attempt("abstract_socket", lambda: abstract_socket(targets["abstract"]))
    attempt("host_write", lambda: host_write(marker))
    if here.get("victim_pid"):
        attempt("signal_job", lambda: signal_victim(int(here["victim_pid"])))
    attempt("signal_daemon", lambda: signal_daemon(int(here["daemon_pid"])))
    for name, target in here.get("connect", {}).items():
        attempt(name, lambda name=name, target=target: connect(name, target))
    for name, target in here.get("udp", {}).items():
        attempt(name, lambda name=name, target=target: udp(name, target))
    attempt("cgroup_escape", cgroup_escape)
    attempt("mknod", mknod_device)
    attempt("devices", open_devices)
    attempt("fork", lambda: fork_many(int(targets.get("fork", 200))))
    if targets.get("kill_all"):
        attempt("kill_all", kill_all)
    attempt("setsid", lambda: setsid_sleeper(marker, float(targets.get("outlive_s", 120))))
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

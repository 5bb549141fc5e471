import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "swarmd.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_verifies(tmp_path):
    # verify checks that ExecStart exists: point it at this checkout's swarmd.
    swarmd = shutil.which("swarmd") or str(Path(__import__("sys").executable).parent / "swarmd")
    unit = tmp_path / "swarmd.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/swarmd", swarmd))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "swarmd.service" not in proc.stderr, proc.stderr  # no warnings about our unit


def test_unit_has_what_the_daemon_relies_on():
    text = UNIT.read_text()
    for line in ["Type=notify", "WatchdogSec=", "Restart=on-failure", "RestartPreventExitStatus=2",
                 "StateDirectory=swarmd", "RuntimeDirectory=swarmd", "ConfigurationDirectory=swarmd",
                 "CAP_NET_ADMIN", "NoNewPrivileges=yes", "ProtectSystem=strict"]:
        assert line in text, line


def unit_settings() -> dict[str, list[str]]:
    """[Service] settings of the shipped unit, each key's values in order (keys may repeat)."""
    out: dict[str, list[str]] = {}
    section = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def writable_under_the_unit(settings: dict[str, list[str]]) -> list[Path]:
    """What ProtectSystem=strict leaves writable: the unit's own directories, ReadWritePaths=, and
    /tmp (private)."""
    words = lambda key: [w for v in settings.get(key, []) for w in v.split()]  # noqa: E731
    return ([Path("/var/lib") / d for d in words("StateDirectory")] + [Path("/run") / d for d in words("RuntimeDirectory")]
            + [Path(p.lstrip("-")) for p in words("ReadWritePaths")]
            + ([Path("/tmp")] if settings.get("PrivateTmp") == ["yes"] else []))


def systemd_env(settings: dict[str, list[str]]) -> dict[str, str]:
    """The environment systemd gives the service for its directories (systemd.exec(5))."""
    words = lambda key: [w for v in settings.get(key, []) for w in v.split()]  # noqa: E731
    return {"STATE_DIRECTORY": ":".join(f"/var/lib/{d}" for d in words("StateDirectory")),
            "RUNTIME_DIRECTORY": ":".join(f"/run/{d}" for d in words("RuntimeDirectory"))}


def paths_the_daemon_writes(env: dict[str, str]) -> dict[str, Path]:
    from swarmd import paths
    from swarmd.config import Config
    from swarmd.wg.userspace import SOCKET_DIR

    state = paths.default_state_dir(env, uid=0)
    config = Config(state_dir=state)
    return {"state dir": state, "jobs dir": config.jobs_path, "socket": paths.default_socket(state, env, uid=0),
            "wireguard-go UAPI sockets": Path(str(SOCKET_DIR).replace("/var/run/", "/run/", 1))}  # /var/run -> /run


@pytest.mark.parametrize("with_env", [True, False], ids=["systemd's environment", "no environment"])
def test_every_default_path_the_daemon_writes_is_writable_under_the_units_hardening(with_env):
    settings = unit_settings()
    assert settings["ProtectSystem"] == ["strict"], "this test assumes the whole file system read-only"
    writable = writable_under_the_unit(settings)
    for what, path in paths_the_daemon_writes(systemd_env(settings) if with_env else {}).items():
        assert any(path == w or w in path.parents for w in writable), \
            f"{what} {path} is read-only under the unit (writable: {', '.join(map(str, writable))})"


def test_the_state_dir_stays_private_and_jobs_live_beside_it():
    settings = unit_settings()
    assert settings["StateDirectoryMode"] == ["0700"]
    written = paths_the_daemon_writes(systemd_env(settings))
    assert written["state dir"] not in written["jobs dir"].parents, \
        "job users must reach the jobs dir, which a 0700 state dir would block"
    assert settings.get("RuntimeDirectoryPreserve") == ["yes"], \
        "/run/wireguard is shared with other wireguard-go users: stopping swarmd must not remove it"


def words(settings: dict[str, list[str]], key: str) -> set[str]:
    return {w for v in settings.get(key, []) for w in v.split()}


def test_the_unit_grants_the_job_sandbox_what_it_needs_and_no_more():
    settings = unit_settings()
    # the daemon writes job cgroups under its own, and a stop still kills every job's processes
    assert settings["Delegate"] == ["yes"] and settings["KillMode"] == ["mixed"]
    assert settings["ProtectControlGroups"] == ["no"]
    # exactly bwrap's namespaces as root (never a blanket `no`: no user, net or time namespace,
    # for the daemon or for a job)
    assert words(settings, "RestrictNamespaces") == {"mnt", "pid", "ipc", "uts", "cgroup"}
    caps = words(settings, "CapabilityBoundingSet")
    # CAP_NET_RAW: routing's echo through a relay (routing/icmp.py); ranks never keep it (setpriv)
    assert {"CAP_SYS_ADMIN", "CAP_SETPCAP", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_SETUID", "CAP_SETGID",
            "CAP_KILL"} <= caps
    assert not caps & {"CAP_SYS_MODULE", "CAP_SYS_PTRACE", "CAP_SYS_TIME", "CAP_SYS_RAWIO", "CAP_SYS_BOOT",
                       "CAP_MKNOD", "CAP_BPF", "CAP_SYS_CHROOT", "CAP_SETFCAP", "CAP_WAKE_ALARM"}
    assert "AF_NETLINK" in words(settings, "RestrictAddressFamilies")  # nft talks netlink
    # no device allowlist, not even an implied one (ProtectClock= on systemd < 253): it would
    # close /dev/net/tun and the GPUs
    assert "DeviceAllow" not in settings and "ProtectClock" not in settings and "PrivateDevices" not in settings
    denied = {w.lstrip("~") for w in words(settings, "SystemCallFilter")}
    assert all(v.startswith("~") for v in settings["SystemCallFilter"]), "a deny list: an allow list would bind every job"
    assert {"@clock", "@swap", "@reboot", "@module", "@raw-io", "@obsolete", "@cpu-emulation"} <= denied
    assert not denied & {"@mount", "@privileged", "@setuid", "@resources", "@process"}, "bwrap, setpriv, torch need these"
    for key, value in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "read-only"),
                       ("PrivateTmp", "yes"), ("RestrictSUIDSGID", "yes"), ("ProtectKernelModules", "yes")]:
        assert settings[key] == [value], key


def test_bwrap_asks_for_no_namespace_the_unit_refuses(tmp_path):
    from swarmd.compute.host.sandbox import mounts

    argv = mounts.bwrap_argv(bwrap="bwrap", top=tmp_path, cwd=tmp_path, hide=[], expose=[], devices=[],
                             uid=61184, gid=61184, setpriv="setpriv")
    flags = {a for a in argv[:argv.index("--")] if a.startswith("--unshare")}
    kinds = {"--unshare-pid": "pid", "--unshare-ipc": "ipc", "--unshare-uts": "uts", "--unshare-cgroup": "cgroup",
             "--unshare-cgroup-try": "cgroup", "--unshare-net": "net", "--unshare-user": "user",
             "--unshare-user-try": "user", "--unshare-all": "all"}
    asked = {"mnt"} | {kinds[f] for f in flags}
    assert asked <= words(unit_settings(), "RestrictNamespaces"), asked


# The real unit under systemd. This machine's PID 1 is not systemd (the VM's own init), but systemd
# 252 boots here in a container: systemd-nspawn (Debian: systemd-container) over an overlay of the
# host's own root file system (the root bound without its submounts, so the host's /dev, /proc and
# /sys stay out; a tmpfs upper layer takes every write), with --register=no --keep-unit (there is no
# systemd on the host to register with or to get a scope from: without them nspawn stops at "Failed
# to open system bus") and --private-network (the unit's firewall and ports stay in the container).
# What it cannot show:
# - cgroup v2 delegation: this host binds memory, cpu and pids to v1 hierarchies (its cgroup2 mount
#   has only hugetlb), so a unified container would have no controller to delegate.
# - v1 delegation by systemd: on a legacy host nspawn mounts the controller hierarchies read-only in
#   the container (only name=systemd is the container's), so the container's systemd realizes no unit
#   cgroup in them at boot, and swarmd says "our memory cgroup ... is not writable". The test remounts
#   them read-write inside the container before starting swarmd, standing in for a host where systemd
#   as PID 1 owns them; the job cgroups then sit under the container's root in each controller, not
#   under system.slice/swarmd.service.
def nspawn_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (mounts, systemd-nspawn)"
    for tool, package in [("systemd-nspawn", "systemd-container"), ("nsenter", "util-linux"), ("bwrap", "bubblewrap"),
                          ("nft", "nftables")]:
        if shutil.which(tool) is None:
            return f"{tool} not installed (Debian: {package})"
    return None if Path("/lib/systemd/systemd").exists() else "systemd not installed"


def container_init(nspawn: int) -> int | None:
    """The pid of the container's systemd: nspawn's child named systemd."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            comm, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
            if comm == "systemd" and int(rest[1]) == nspawn:
                return int(stat.parent.name)
    return None


class Container:
    def __init__(self, nspawn: subprocess.Popen, init: int):
        self.nspawn, self.init = nspawn, init

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["nsenter", "-t", str(self.init), "-a", *argv], capture_output=True, text=True,
                              timeout=timeout, cwd="/")

    def sh(self, script: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.run("sh", "-c", script, timeout=timeout)


@pytest.fixture
def booted(tmp_path):
    """systemd booted in a container over this host's tree, with the shipped unit installed."""
    if (why := nspawn_missing()) is not None:
        pytest.skip(why)
    from netlab.support import until

    lower, rw, root = tmp_path / "lower", tmp_path / "rw", tmp_path / "root"
    mounted: list[Path] = []
    nspawn = None
    try:
        def mount(target: Path, *args: str) -> None:
            target.mkdir(exist_ok=True)
            done = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
            if done.returncode != 0:  # a container without CAP_SYS_ADMIN, a kernel without overlayfs
                pytest.skip(f"cannot build the container's root here: mount {' '.join(args)}: {done.stderr.strip()}")
            mounted.append(target)

        mount(lower, "--bind", "/")
        mount(rw, "-t", "tmpfs", "tmpfs")
        (rw / "up").mkdir()
        (rw / "work").mkdir()
        mount(root, "-t", "overlay", "overlay", "-o", f"lowerdir={lower},upperdir={rw / 'up'},workdir={rw / 'work'}")
        # a machine of its own: its own machine id, no swarmd state or config of the host's
        (root / "etc/machine-id").write_text(uuid.uuid4().hex + "\n")
        for d in ("var/lib/swarmd", "var/lib/swarmd-jobs", "etc/swarmd", "run/swarmd"):
            shutil.rmtree(root / d, ignore_errors=True)
        swarmd = str(Path(sys.executable).parent / "swarmd")
        (root / "etc/systemd/system/swarmd.service").write_text(UNIT.read_text().replace("/usr/local/bin/swarmd", swarmd))
        if Path(swarmd).resolve().is_relative_to("/tmp"):  # a checkout under /tmp (a fresh clone there):
            # the unit's PrivateTmp would hide this very swarmd from it; the rest stays as shipped
            dropin = root / "etc/systemd/system/swarmd.service.d"
            dropin.mkdir(parents=True, exist_ok=True)
            (dropin / "checkout-in-tmp.conf").write_text("[Service]\nPrivateTmp=no\n")
        console = open(tmp_path / "console.log", "w")  # noqa: SIM115 (closed with the container)
        machine = f"swarmd-test-{os.getpid()}"
        in_tmp = Path(swarmd).resolve().is_relative_to("/tmp")  # nspawn gives the container a /tmp of its own
        checkout = [f"--bind-ro={Path(sys.prefix).parent}"] if in_tmp else []
        nspawn = subprocess.Popen(["systemd-nspawn", "-D", str(root), "--boot", f"--machine={machine}",
                                   "--register=no", "--keep-unit", "--link-journal=no", "--private-network",
                                   *checkout],
                                  stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT)
        console_text = lambda: (tmp_path / "console.log").read_text()[-2000:]  # noqa: E731
        until(lambda: nspawn.poll() is not None or container_init(nspawn.pid) is not None, 60,
              "systemd starts in the container", detail=console_text)
        assert nspawn.poll() is None, console_text()
        box = Container(nspawn, container_init(nspawn.pid))
        state = lambda: box.run("systemctl", "is-system-running", timeout=30)  # noqa: E731
        until(lambda: state().stdout.strip() in ("running", "degraded"), 120, "the container's systemd is up",
              detail=lambda: repr(state()) + console_text())
        # stands in for systemd as PID 1 owning the v1 controllers (see above)
        box.sh("for c in /sys/fs/cgroup/*/; do mount -o remount,bind,rw $c; done")
        yield box
    finally:
        if nspawn is not None:
            if nspawn.poll() is None and (init := container_init(nspawn.pid)) is not None:
                subprocess.run(["nsenter", "-t", str(init), "-a", "systemctl", "poweroff", "--no-block"],
                               capture_output=True, timeout=30)
            try:
                nspawn.wait(timeout=60)
            except subprocess.TimeoutExpired:
                nspawn.kill()
                nspawn.wait()
            console.close()
            with contextlib.suppress(OSError):  # nspawn leaves it where /run is not a tmpfs, as here
                (Path("/run/systemd/nspawn/propagate") / machine).rmdir()
        for target in reversed(mounted):
            subprocess.run(["umount", "-l", str(target)], capture_output=True)


def remove_cgroups(name: str) -> None:
    """The daemon's own cgroups (swarmd-<peer>), left in each v1 controller after the container is gone.
    They may be going while we look (the unit's stop removes them too): os.walk skips a directory that
    vanished, where Path.glob raised FileNotFoundError from its scandir."""
    tops = [os.path.join(root, d) for root, dirs, _ in os.walk("/sys/fs/cgroup") for d in dirs if d == name]
    for top in tops:
        inner = [os.path.join(root, d) for root, dirs, _ in os.walk(top) for d in dirs]
        for d in sorted(inner, key=lambda p: p.count(os.sep), reverse=True) + [top]:  # leaves first
            with contextlib.suppress(OSError):
                os.rmdir(d)


@pytest.mark.slow
def test_the_unit_starts_swarmd_runs_a_sandboxed_job_and_stops_under_systemd(booted):
    assert booted.run("systemctl", "start", "swarmd", timeout=60).returncode == 0, \
        booted.run("journalctl", "-u", "swarmd", "--no-pager", "-n", "30").stdout
    peer = None
    try:
        journal = booted.run("journalctl", "-u", "swarmd", "--no-pager", "-o", "cat").stdout
        ready = [json.loads(line) for line in journal.splitlines() if '"job sandbox ready"' in line]
        assert ready, f"the sandbox is not complete under the unit:\n{journal}"
        assert ready[-1]["cgroup"].startswith("cgroup v1") and "bubblewrap" in ready[-1]["namespaces"]
        assert ready[-1]["firewall"].startswith("nftables"), ready[-1]
        peer = ready[-1]["peer"]
        swarmctl = str(Path(sys.executable).parent / "swarmctl")
        assert booted.run(swarmctl, "swarm", "init").returncode == 0
        # wireguard-go gets /dev/net/tun and its calls under the unit (no device allowlist, the deny list)
        from netlab.support import until
        unit_log = lambda: booted.run("journalctl", "-u", "swarmd", "--no-pager", "-o", "cat").stdout  # noqa: E731
        until(lambda: '"event": "mesh up"' in unit_log(), 30, "the mesh comes up under the unit", detail=unit_log)

        started = [json.loads(line) for line in journal.splitlines() if '"event": "ready"' in line][-1]
        port = int(started["listen"][0].split("/tcp/")[1].split("/")[0])
        connect = ("import socket; s = socket.socket(); s.settimeout(2); "
                   f"print('libp2p', 'reached' if s.connect_ex(('127.0.0.1', {port})) == 0 else 'blocked')")
        probe = ("id -u; grep -E 'CapEff|CapBnd|NoNewPrivs' /proc/self/status; echo pid $$; "
                 "touch /usr/swarmd-probe 2>/dev/null || echo usr read-only; "
                 "test -e /var/lib/swarmd/identity.key || echo state hidden; "
                 f"test -e {started['socket']} || echo socket hidden; python3 -c \"{connect}\"")
        assert booted.run("python3", "-c", connect).stdout.strip() == "libp2p reached"  # from outside a job
        job = booted.run(swarmctl, "jobs", "run", "--mem", "128M", "--", "sh", "-c", probe, timeout=120)
        assert job.returncode == 0, job.stdout + job.stderr
        lines = [line.removeprefix("[rank 0] ") for line in job.stdout.splitlines()]
        assert 61184 <= int(lines[0]) <= 65519, lines
        assert {"CapEff:\t0000000000000000", "CapBnd:\t0000000000000000", "NoNewPrivs:\t1", "pid 2",
                "usr read-only", "state hidden", "socket hidden", "libp2p blocked"} <= set(lines), lines

        oom = booted.run(swarmctl, "jobs", "run", "--mem", "64M", "--", "python3", "-c",
                         "b = bytearray(300 << 20)", timeout=120)
        assert oom.returncode != 0 and "out of memory (limit 64 MiB)" in oom.stdout + oom.stderr, oom

        left = booted.run(swarmctl, "jobs", "run", "--detach", "--", "sh", "-c", "setsid sleep 600 & exec sleep 600")
        assert left.returncode == 0, left
        job_uids = "ps -eo uid= | awk '$1 >= 61184 && $1 <= 65519' | wc -l"
        until(lambda: booted.sh(job_uids).stdout.strip() == "2", 30, "the detached job runs")
        assert booted.run("systemctl", "stop", "swarmd", timeout=60).returncode == 0
        assert booted.run("systemctl", "is-active", "swarmd").stdout.strip() == "inactive"
        assert booted.sh(job_uids).stdout.strip() == "0", "a job's process outlived the service"
    finally:
        if peer is not None:
            booted.run("systemctl", "stop", "swarmd", timeout=60)
            remove_cgroups(f"swarmd-{peer[-8:]}")

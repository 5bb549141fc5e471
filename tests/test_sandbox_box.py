"""sandbox.box: what this host can confine, and one job's box from start to end, with the
real parts where this machine has them (root, cgroups, bubblewrap, nftables)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
import trio

from swarmd.compute.sandbox import box as boxmod
from swarmd.compute.sandbox.box import PARTS, Sandbox, SandboxError, Settings

UIDS = (64900, 64999)  # apart from the lab's slices and the default's low end


def settings(tmp_path: Path, mode: str = "auto") -> Settings:
    jobs = tmp_path / "jobs"
    jobs.mkdir(exist_ok=True)
    jobs.chmod(0o711)
    return Settings(mode=mode, uids=UIDS, egress="mesh", egress_allow=(), paths=(), pids=64,
                    state_dir=tmp_path / "state", jobs_dir=jobs, socket=tmp_path / "swarmd.sock",
                    name=f"swarmd-t{uuid.uuid4().hex[:8]}")


async def test_off_confines_nothing_and_says_so(tmp_path):
    sb = await Sandbox.start(settings(tmp_path, "off"))
    assert sb.status() == {"mode": "off", "active": False, "complete": False,
                           "parts": {p: "off: sandbox = off" for p in PARTS}}
    async with sb.open(job="j", top=tmp_path, cwd=tmp_path, memory=None, cpus=None, gpus=()) as box:
        assert box.uid is None and box.command(["true"], {"A": "1"}, 0) == (["true"], {"A": "1"})


async def test_required_refuses_a_job_when_a_part_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(boxmod.mounts, "detect_bwrap", lambda: "bwrap (bubblewrap) is not installed")
    sb = await Sandbox.start(settings(tmp_path, "required"))
    try:
        assert sb.parts["namespaces"] == "off: bwrap (bubblewrap) is not installed" and not sb.complete
        with pytest.raises(SandboxError, match="namespaces: bwrap .bubblewrap. is not installed"):
            async with sb.open(job="j", top=tmp_path, cwd=tmp_path, memory=None, cpus=None, gpus=()):
                pass
    finally:
        await sb.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's parts need root")
async def test_a_box_runs_its_command_as_its_uid_and_leaves_nothing(tmp_path):
    sb = await Sandbox.start(settings(tmp_path))
    try:
        assert sb.complete, sb.parts
        top = tmp_path / "jobs" / "d212xxxxxxxx-00000000"
        (top / "work").mkdir(parents=True)
        async with sb.open(job="j", top=top, cwd=top / "work", memory=64 << 20, cpus=1.0, gpus=()) as box:
            assert box.parts == PARTS and box.uid is not None and UIDS[0] <= box.uid <= UIDS[1]
            os.chown(top / "work", box.uid, box.uid)
            script = "id -u; touch mine; ls /proc | grep -c '^[0-9]'; setsid sleep 300 >/dev/null 2>&1 & echo started"
            out = tmp_path / "out"
            with open(out, "wb") as f:  # not a pipe: bubblewrap's pid 1 holds it while the sleep lives
                argv, env = box.command(["/bin/sh", "-c", script], {"PATH": "/usr/bin:/bin"}, 0)
                done = await trio.run_process(argv, env=env, stdout=f, stderr=f, check=False)
            assert done.returncode == 0, out.read_text()
            uid, procs, started = out.read_text().split()
            assert int(uid) == box.uid and int(procs) <= 4 and started == "started"
            assert box.cgroup is not None and box.cgroup.pids(), "the setsid'd sleep is still in the cgroup"
            chains = subprocess.run(["nft", "list", "chain", "inet", "swarmd_jobs", f"job_{box.uid}"],
                                    capture_output=True)
            assert chains.returncode == 0
        assert box.usage is not None and box.usage.peak_memory and box.usage.oom_kills == 0
        assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _uid(p) == box.uid], \
            "no process of the job's uid survives its box"
        assert (top / "work" / "mine").stat().st_uid == os.geteuid(), "its files are handed back"
        assert subprocess.run(["nft", "list", "chain", "inet", "swarmd_jobs", f"job_{box.uid}"],
                              capture_output=True).returncode != 0, "its firewall chain is gone"
        assert sb.pool is not None and sb.pool.allocate() == box.uid, "the uid is free again"
    finally:
        await sb.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's parts need root")
async def test_the_jobs_environment_never_reaches_the_stages_that_run_as_root(tmp_path):
    """A job's env with LD_PRELOAD (a library of its workdir) or BASH_ENV ran its code as
    root in sh and bwrap, before anything was confined."""
    sb = await Sandbox.start(settings(tmp_path))
    try:
        top = tmp_path / "jobs" / "d212yyyyyyyy-00000000"
        (top / "work").mkdir(parents=True)
        marker = tmp_path / "ran-as-root"
        hostile = {"LD_PRELOAD": "/nonexistent/evil.so", "BASH_ENV": str(tmp_path / "evil.sh"), "ENV": "x",
                   "SECRET": "it's \"quoted\" $(touch /tmp/never) `x`\nand two lines", "PATH": "/usr/bin:/bin"}
        (tmp_path / "evil.sh").write_text(f"touch {marker}\n")
        async with sb.open(job="j", top=top, cwd=top / "work", memory=None, cpus=None, gpus=()) as box:
            argv, env = box.command(["/usr/bin/env"], hostile, 0)
            assert env == boxmod.CHAIN_ENV and not any(v in " ".join(argv) for v in ("evil", "SECRET"))
            out = tmp_path / "out"
            with open(out, "wb") as f:
                done = await trio.run_process(argv, env=env, stdout=f, stderr=f, check=False)
            seen = out.read_text()
        assert done.returncode == 0, seen
        assert "SECRET=it's \"quoted\" $(touch /tmp/never) `x`\nand two lines\n" in seen, seen
        assert "LD_PRELOAD=/nonexistent/evil.so" in seen, "the rank itself gets what it asked for"
        assert not marker.exists() and not Path("/tmp/never").exists()
        assert (top / ".env-0").stat().st_mode & 0o777 == 0o400
    finally:
        await sb.close()


def _uid(proc: Path) -> int | None:
    try:
        for line in (proc / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None

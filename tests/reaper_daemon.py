"""A stand-in for swarmd in test_sandbox_reaper.py: runs one job's ranks with the real
Executor (in a real sandbox box when asked), prints what the test needs, and waits to be
SIGKILLed like a daemon that dies without a word.

Argument: JSON {"cwd", "scripts": [sh script per rank], "user", "sandbox": null or
{"dir", "name", "uids"}}. Prints `reaper PID`, then `cgroup DIR…` in a box, then each rank's
output as `RANK LINE`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import trio

from swarmd.compute.host.executor import Executor, RankProc
from swarmd.compute.host.sandbox.box import Sandbox, Settings

ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/"}


def settings(directory: Path, name: str, uids: list[int]) -> Settings:
    return Settings(mode="auto", uids=(uids[0], uids[1]), egress="mesh", egress_allow=(), paths=(), pids=64,
                    state_dir=directory / "state", jobs_dir=directory / "jobs", socket=directory / "swarmd.sock",
                    name=name)


async def run(executor: Executor) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        assert executor.fence is not None
        print("reaper", executor.fence.proc.pid, flush=True)


async def main(cfg: dict) -> None:
    def out(rank: int, line: bytes) -> None:
        print(rank, line.decode(), flush=True)

    def ranks(cwd: Path) -> list[RankProc]:
        return [RankProc(rank=i, local_rank=i, argv=["/bin/sh", "-c", s], env=ENV, cwd=cwd)
                for i, s in enumerate(cfg["scripts"])]

    if cfg["sandbox"] is None:
        await run(Executor("j1", ranks(Path(cfg["cwd"])), user=cfg["user"], on_output=out))
        return
    box_cfg = cfg["sandbox"]
    directory = Path(box_cfg["dir"])
    sb = await Sandbox.start(settings(directory, box_cfg["name"], box_cfg["uids"]))
    top = directory / "jobs" / "d212ffffffff-00000000"
    (top / "work").mkdir(parents=True)
    async with sb.open(job="j1", top=top, cwd=top / "work", memory=None, cpus=None, gpus=()) as box:
        assert box.uid is not None and box.cgroup is not None, box.parts
        os.chown(top / "work", box.uid, box.uid)
        print("cgroup", *box.cgroup.dirs, flush=True)
        await run(Executor("j1", ranks(top / "work"), user=None, on_output=out, box=box))


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))

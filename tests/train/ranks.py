"""Run a function on N gloo ranks in forked processes (no re-import of torch: ~0.5 s a run)."""

from __future__ import annotations

import io
import multiprocessing
import os
import time
import traceback

import torch


def _rank(fn, rank: int, world: int, store: str, env: dict, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        os.environ.update(env)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        out = io.BytesIO()
        torch.save(fn(rank, world), out)  # bytes: a tensor put as itself is shared memory its dead rank held
        queue.put((rank, "ok", out.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        os._exit(0)  # gloo's teardown can abort when peers left first (pytorch#179291)


def run(fn, world: int, tmp_path, env_of=lambda rank: {}, timeout: float = 60.0) -> list:
    """``fn(rank, world)``'s return values in rank order; a rank's exception fails the caller."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()  # put writes at once: the rank ends with os._exit
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_rank, args=(fn, r, world, store, env_of(r), queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict()
        deadline = time.monotonic() + timeout
        for _ in range(world):
            while not queue._reader.poll(0.1):  # SimpleQueue.get has no timeout
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks {sorted(set(range(world)) - set(results))} silent for {timeout} s")
            rank, status, value = queue.get()
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()

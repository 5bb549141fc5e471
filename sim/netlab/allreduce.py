"""One rank of a gloo all-reduce between lab hosts: the mesh test's and the bench's workload.

Run inside a host's namespace: ``python -m sim.netlab.allreduce --rank R --world N --master
ADDR --iface IFACE [--mb 16 --rounds 5]``. Prints one JSON line: the sum it got back (each
rank contributes rank + 1, so the right answer is N (N + 1) / 2) and, with ``--mb``, the
bus bandwidth of the timed rounds. ``GLOO_SOCKET_IFNAME`` pins gloo to the interface given:
without it gloo binds to the hostname's address, which is loopback (DESIGN).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from datetime import timedelta


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="rank 0's address on the chosen interface")
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--iface", required=True)
    p.add_argument("--mb", type=float, default=0.0, help="also time all-reduces of this many MB")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    os.environ["GLOO_SOCKET_IFNAME"] = args.iface
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=60))
    t = torch.full((4,), float(args.rank + 1))
    dist.all_reduce(t)
    out: dict[str, float] = {"sum": float(t[0])}
    if args.mb:
        big = torch.ones(int(args.mb * 1e6 / 4), dtype=torch.float32)
        dist.all_reduce(big)  # warm-up: connections and buffers
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.rounds):
            dist.all_reduce(big)
        seconds = (time.perf_counter() - start) / args.rounds
        # bus bandwidth, as nccl-tests count it: each rank sends and receives 2 (N-1)/N of the data
        out["busbw_mb_s"] = args.mb * 2 * (args.world - 1) / args.world / seconds
        out["seconds"] = seconds
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

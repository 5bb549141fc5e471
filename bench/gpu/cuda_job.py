"""A rank of `jobs run --gpus-per-node 1` (bench/gpu, check 2): what the GPU path gives a job.

Prints one JSON line: the CUDA_VISIBLE_DEVICES it got, the devices torch sees, NCCL brought
up over the job's rendezvous (world of one rank: NCCL still initialises its transport on the
interface the job was given), a 1 GiB all-reduce's time, an 8192^3 bf16 matmul's TFLOP/s,
and which /dev/nvidia* device nodes other than its own GPU it could open (the sandbox's
device rules should refuse them; with one GPU there is no other to try, and it says so).
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

out: dict = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
             "device_count": torch.cuda.device_count(), "cuda": torch.cuda.is_available()}
if torch.cuda.is_available():
    torch.cuda.set_device(0)
    out["device"] = torch.cuda.get_device_name(0)
    dist.init_process_group("nccl")
    out["nccl"] = dist.get_backend() == "nccl"
    out["nccl_socket_ifname"] = os.environ.get("NCCL_SOCKET_IFNAME")
    x = torch.ones(256 * 1024 * 1024, device="cuda")  # 1 GiB of float32
    dist.all_reduce(x)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    out["allreduce_1gib_ms"] = round((time.perf_counter() - began) / 5 * 1000, 2)
    out["allreduce_ok"] = bool(x[0].item() == 1.0)
    del x
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    out["matmul_bf16_tflops"] = round(2 * 8192 ** 3 * 10 / (time.perf_counter() - began) / 1e12, 1)
    dist.destroy_process_group()
others = sorted(p for p in os.listdir("/dev") if p.startswith("nvidia") and p[6:].isdigit() and p != "nvidia0")
opened = []
for name in others:
    try:
        os.close(os.open(f"/dev/{name}", os.O_RDWR))
        opened.append(name)
    except OSError:
        pass
out["other_gpu_nodes"], out["other_gpu_nodes_opened"] = others, opened
print(json.dumps(out), flush=True)

"""A rank that brings CUDA up, then takes host memory past the job's limit (bench/gpu, check 3):
the sandbox's memory cgroup kills it and the job's reason says "out of memory (limit …)"."""

from __future__ import annotations

import sys

import torch

if torch.cuda.is_available():
    torch.zeros(1, device="cuda")  # a CUDA context: its host memory counts against the limit too
print("cuda up" if torch.cuda.is_available() else "no cuda", flush=True)
hog = []
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 64):
    hog.append(bytearray(256 << 20))  # 256 MiB at a time, touched
print("never reached: the limit did not hold", flush=True)

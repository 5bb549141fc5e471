"""DistributedDataParallel on scikit-learn's handwritten digits (8×8 images, 10 classes).

An ordinary torchrun script: it reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the
environment (swarmd sets them as torchrun does) and trains a small MLP with the gloo
backend (nccl when every rank has a GPU). The global batch is fixed and split among the
ranks, so one node or three reach the same accuracy, within noise.

    swarmctl jobs run --nodes 3 --workdir examples -- python ddp_digits.py
    torchrun --nproc-per-node 2 examples/ddp_digits.py        # the same script, locally
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    torch.manual_seed(args.seed)

    train, test = data(args.seed)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=max(1, args.global_batch // world), sampler=sampler)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    if rank == 0:
        print(f"world {world} ({os.environ.get('SWARM_NODE_IPS', 'local')}), {len(train)} train / "
              f"{len(test)} test samples, global batch {args.global_batch}", flush=True)
    started, seen = time.perf_counter(), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)  # summed loss, samples
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(total)
        seen += int(total[1].item())
        if rank == 0 and (epoch % 5 == 4 or epoch == 0):
            print(f"epoch {epoch + 1:3d}  loss {total[0].item() / total[1].item():.4f}", flush=True)
    elapsed = time.perf_counter() - started

    model.eval()
    correct = torch.zeros(2, device=device)
    shard = torch.utils.data.Subset(test, range(rank, len(test), world))
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=256):
            correct += torch.tensor([(model(x.to(device)).argmax(1) == y.to(device)).sum().item(), len(y)],
                                    dtype=torch.float32, device=device)
    dist.all_reduce(correct)
    if rank == 0:
        print(f"test accuracy {correct[0].item() / correct[1].item():.4f} "
              f"({int(correct[0].item())}/{int(correct[1].item())}); "
              f"{seen / elapsed:.0f} samples/s over {world} rank(s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

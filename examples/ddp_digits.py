"""DistributedDataParallel on scikit-learn's handwritten digits (8×8 images, 10 classes).

An ordinary torchrun script: it reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the
environment (swarmd sets them as torchrun does) and trains a small MLP with the gloo
backend (nccl when every rank has a GPU). The global batch is fixed and split among the
ranks, so one node or three reach the same accuracy, within noise.

    swarmctl jobs run --nodes 3 --workdir examples -- python ddp_digits.py
    torchrun --nproc-per-node 2 examples/ddp_digits.py        # the same script, locally

Elastic: it follows torchrun's checkpoint contract. After every epoch rank 0 saves model,
optimizer and epoch into $SWARM_CHECKPOINT_DIR (a temporary name, then a rename, so a
half-written file is never taken for a checkpoint), and at start every rank loads the
newest one there and prints `resumed from epoch E`. After its first step of an attempt
rank 0 prints `first step` (the benchmark times a restart by it). So a job that loses a
host resumes where it was:

    swarmctl jobs run --nodes 2:3 --max-restarts 3 --workdir examples -- python ddp_digits.py

Across the internet (`--sync`, swarmd.train): `ddp` all-reduces every step (the default);
`local:H` averages the models every H steps (torch's PeriodicModelAverager); `diloco:H`
takes H inner steps, then DiLoCo's outer step on the averaged outer gradient, sent as
`--compression fp16` or `int8`; `--fragments F --overlap T` streams it (Streaming DiLoCo: F
parts in turn, each sync overlapped with T inner steps). With `jobs run --groups auto` the
hosts near each other sync every step and only the groups sync every H steps. The sync
state (DiLoCo's outer momentum and the round's start) is in the checkpoint: a restart loses
no outer step.

    swarmctl jobs run --nodes 3 --groups auto --workdir examples -- python ddp_digits.py --sync diloco:16

`--sync torch-postlocal:H` is the anchor `make bench` sets beside them: torch's own
PostLocalSGDOptimizer (DDP for the first H steps, then each rank alone, the models averaged
every H steps; no resume of its state, and no groups).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from swarmd import train as swarm_train


def data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


class TorchPostLocalSGD:
    """torch's PostLocalSGDOptimizer behind the few calls the script makes of a swarmd.train
    plan: DDP with torch's post-local-SGD hook (a global all-reduce for the first H steps, then
    within each rank's subgroup, here the rank alone: gloo needs one given), the optimiser
    wrapped to average the models every H steps after that."""

    def __init__(self, every: int) -> None:
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        self.every, self.syncs, self.params = every, 0, []
        self.averager = PeriodicModelAverager(period=every, warmup_steps=every)

    def describe(self) -> str:
        return f"torch's PostLocalSGDOptimizer: ddp for {self.every} steps, then averaging every {self.every}"

    def wrap(self, model: nn.Module, **ddp) -> nn.Module:
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

        self.params = list(model.parameters())
        alone, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
        wrapped = nn.parallel.DistributedDataParallel(model, **ddp)
        wrapped.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=alone,
                                                     start_localSGD_iter=self.every), post_localSGD_hook)
        return wrapped

    def optimizer(self, inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
        from torch.distributed.optim import PostLocalSGDOptimizer

        return PostLocalSGDOptimizer(optim=inner, averager=self.averager)

    def step(self) -> bool:
        done = self.averager.step - 1  # the step just taken: averaged from H on, every H (torch's rule)
        synced = done >= self.every and done % self.every == 0
        self.syncs += synced
        return synced

    def finish(self) -> None:
        from torch.distributed.algorithms.model_averaging.utils import average_parameters

        average_parameters(iter(self.params), dist.group.WORLD)  # one model to test, as the others end with

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


CHECKPOINT = re.compile(r"epoch-(\d+)\.pt")
KEEP = 2


def newest_checkpoint(directory: Path | None) -> Path | None:
    if directory is None or not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := CHECKPOINT.fullmatch(p.name))]
    return max(found)[1] if found else None


def save_checkpoint(directory: Path, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    sync: dict) -> None:
    """Write to a temporary name, then rename: the contract swarmd replicates by."""
    final = directory / f"epoch-{epoch:04d}.pt"
    temporary = directory / f".{final.name}.tmp"
    torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "sync": sync},
               temporary)
    os.replace(temporary, final)
    for old in sorted(p for p in directory.iterdir() if CHECKPOINT.fullmatch(p.name))[:-KEEP]:
        old.unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5, help="print the loss every this many epochs")
    p.add_argument("--sync", default="ddp", help="ddp (every step), local:H or diloco:H (every H steps)")
    p.add_argument("--compression", default="fp16", choices=("fp32", "fp16", "int8"),
                   help="how diloco sends its outer gradient")
    p.add_argument("--outer-lr", type=float, default=swarm_train.OUTER_LR, help="diloco's outer learning rate")
    p.add_argument("--outer-momentum", type=float, default=swarm_train.OUTER_MOMENTUM,
                   help="diloco's outer Nesterov momentum")
    p.add_argument("--fragments", type=int, default=1,
                   help="diloco: sync the model in this many parts in turn (Streaming DiLoCo)")
    p.add_argument("--overlap", type=int, default=0, help="diloco: each sync overlapped with this many inner steps")
    p.add_argument("--min-epoch-s", type=float, default=0.0,
                   help="pace each epoch to at least this long (a demo's time to crash a host mid-run)")
    args = p.parse_args()
    ckpt_dir = Path(os.environ["SWARM_CHECKPOINT_DIR"]) if os.environ.get("SWARM_CHECKPOINT_DIR") else None

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    torch.manual_seed(args.seed)

    train, test = data(args.seed)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=max(1, args.global_batch // world), sampler=sampler)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    if (anchor := re.fullmatch(r"torch-postlocal:([1-9]\d{0,3})", args.sync)) is not None:
        if args.fragments != 1 or args.overlap:
            p.error("--fragments and --overlap are Streaming DiLoCo's (diloco:H), not torch's anchor")
        sync = TorchPostLocalSGD(int(anchor.group(1)))
    else:
        try:
            sync = swarm_train.plan(args.sync, compression=args.compression, outer_lr=args.outer_lr,
                                    outer_momentum=args.outer_momentum, fragments=args.fragments, delay=args.overlap)
        except ValueError as exc:
            p.error(str(exc))
    ddp = sync.wrap(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if anchor is not None:
        optimizer = sync.optimizer(optimizer)
    loss_fn = nn.CrossEntropyLoss()
    first_epoch = 0
    if (newest := newest_checkpoint(ckpt_dir)) is not None:
        # weights_only: a checkpoint comes from rank 0's host, and unpickling runs whatever it says
        state = torch.load(newest, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if state.get("sync"):
            sync.load_state_dict(state["sync"])
        first_epoch = state["epoch"] + 1
        if rank == 0:
            print(f"resumed from epoch {state['epoch'] + 1} ({newest.name}, restart "
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})", flush=True)

    if rank == 0:
        print(f"world {world} ({os.environ.get('SWARM_NODE_IPS', 'local')}), {len(train)} train / "
              f"{len(test)} test samples, global batch {args.global_batch}; sync: {sync.describe()}", flush=True)
    started, seen, stepped = time.perf_counter(), 0, False
    for epoch in range(first_epoch, args.epochs):
        epoch_started = time.perf_counter()
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)  # summed loss, samples (this rank's)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizer.step()
            sync.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
            if not stepped and rank == 0:
                print(f"first step at {time.time():.3f}", flush=True)
            stepped = True
        seen += int(total[1].item())
        if epoch % args.log_every == args.log_every - 1 or epoch == first_epoch:  # the same epochs on every rank
            dist.all_reduce(total)  # a collective only when logged: over a WAN each costs round trips
            if rank == 0:
                print(f"epoch {epoch + 1:3d}  loss {total[0].item() / total[1].item():.4f}", flush=True)
        if rank == 0 and ckpt_dir is not None:
            save_checkpoint(ckpt_dir, epoch, model, optimizer, sync.state_dict())
        if (rest := args.min_epoch_s - (time.perf_counter() - epoch_started)) > 0:
            time.sleep(rest)
    sync.finish()  # local/diloco: every rank ends with the one model (a cut-short round's sync)
    elapsed = max(time.perf_counter() - started, 1e-9)

    model.eval()
    correct = torch.zeros(2, device=device)
    shard = torch.utils.data.Subset(test, range(rank, len(test), world))
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=256):
            correct += torch.tensor([(model(x.to(device)).argmax(1) == y.to(device)).sum().item(), len(y)],
                                    dtype=torch.float32, device=device)
    counted = torch.tensor([float(seen)], device=device)
    dist.all_reduce(correct)
    dist.all_reduce(counted)
    seen = int(counted.item())  # every rank's samples
    if rank == 0:
        print(f"test accuracy {correct[0].item() / correct[1].item():.4f} "
              f"({int(correct[0].item())}/{int(correct[1].item())}); "
              f"{seen / elapsed:.0f} samples/s over {world} rank(s); {sync.syncs} syncs across groups", flush=True)
    dist.barrier()  # every rank done with its collectives
    # No destroy_process_group(): gloo's teardown aborts (SIGABRT, "terminate called without an
    # active exception") a rank whose peers closed their sockets first, even after a barrier (two
    # lab tests of one make test here; pytorch/pytorch#179291). Nothing is left that the OS does not free.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

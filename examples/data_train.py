"""Ray Data feeding Ray Train: digits streamed through a preprocessing step into a TorchTrainer.

The driver loads scikit-learn's handwritten digits into a Ray Dataset (in the object store,
in blocks). Every epoch, Ray Data runs `preprocess` over those blocks as tasks on whichever
nodes have a free CPU (here it only scales the pixels to 0-1; a real pipeline would decode,
augment, tokenize) and streams the batches to the training workers as they are ready, each
worker reading its own share. The workers are
ray.train.torch.TorchTrainer's: one per node by default (SPREAD), each with half a CPU so
the node's other half is left to Ray Data, training the MLP of ddp_digits.py with
DistributedDataParallel over gloo (on the swarm GLOO_SOCKET_IFNAME, already in the
environment, keeps gloo on the job's mesh interface).

FailureConfig(max_failures=2): if a worker or its node is lost, Train restarts the worker
group (on the nodes left) up to twice. Nothing is checkpointed (that would need storage every
node can reach), so a restarted run starts again from epoch 1; the run's files stay in the
driver host's temp dir.

    swarmctl jobs run --ray --nodes 3 --cpus 2 --workdir examples -- python data_train.py
    python examples/data_train.py --workers 1          # the same script on a local Ray

Prints `train workers by node: <ip>=<count>, ...` and `test accuracy: 0.xxxx`.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time

import numpy as np
import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train.torch import TorchTrainer, prepare_model
from ray.util.queue import Queue
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--workers", type=int, default=None, help="training workers (default: one per node)")
    p.add_argument("--global-batch", type=int, default=128, help="split evenly among the workers")
    p.add_argument("--lr", type=float, default=0.1)
    return p.parse_args(argv)


def preprocess(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Runs in Ray Data tasks, on any node, a block of rows at a time."""
    return {"image": batch["image"].astype(np.float32) / 16.0, "label": batch["label"]}


def train_loop(config: dict) -> None:
    """Runs on every training worker; Ray Train has set up torch.distributed (gloo) already."""
    torch.set_num_threads(1)  # one CPU per worker
    context = ray.train.get_context()
    world = context.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every worker (DDP also broadcasts rank 0's)
    model = prepare_model(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))  # wraps it in DDP
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    train_shard = ray.train.get_dataset_shard("train")  # this worker's share of the stream
    test_shard = ray.train.get_dataset_shard("test")
    batch_size = max(1, config["global_batch"] // world)

    # Where the workers run, gathered so that rank 0 can tell the driver.
    nodes = [None] * world
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())

    for epoch in range(config["epochs"]):
        model.train()
        total, seen = 0.0, 0
        for batch in train_shard.iter_torch_batches(batch_size=batch_size, dtypes={"image": torch.float32,
                                                                                   "label": torch.long}):
            optimizer.zero_grad()
            loss = loss_fn(model(batch["image"]), batch["label"])
            loss.backward()
            optimizer.step()
            total, seen = total + loss.item() * len(batch["label"]), seen + len(batch["label"])

        model.eval()
        counts = torch.zeros(2)  # right, all: summed over the workers' shares of the test set
        with torch.no_grad():
            for batch in test_shard.iter_torch_batches(batch_size=256, dtypes={"image": torch.float32,
                                                                               "label": torch.long}):
                counts += torch.tensor([(model(batch["image"]).argmax(1) == batch["label"]).sum().item(),
                                        len(batch["label"])], dtype=torch.float32)
        dist.all_reduce(counts)
        if context.get_world_rank() == 0:
            config["progress"].put({"epoch": epoch + 1, "loss": total / max(seen, 1),
                                    "test_accuracy": (counts[0] / counts[1]).item(), "nodes": nodes})


def main() -> None:
    args = parse_args()
    ray.init()  # RAY_ADDRESS (set by the swarm) names the cluster; without it, a local Ray starts
    ray.data.DataContext.get_current().enable_progress_bars = False  # they redraw; this is a log
    alive = [n for n in ray.nodes() if n["Alive"]]
    workers = args.workers or len(alive)

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(digits.data, digits.target, test_size=0.25, random_state=0,
                                                        stratify=digits.target)
    # Several blocks, so that several preprocessing tasks can run at once, on several nodes.
    train = ray.data.from_items([{"image": x, "label": y} for x, y in zip(x_train, y_train)], override_num_blocks=8)
    test = ray.data.from_items([{"image": x, "label": y} for x, y in zip(x_test, y_test)], override_num_blocks=4)
    datasets = {
        # Lazy: nothing runs until the workers iterate, and then again every epoch.
        # A quarter of a CPU per task: they are light, and fit beside the training workers.
        "train": train.map_batches(preprocess, batch_format="numpy", num_cpus=0.25),
        "test": test.map_batches(preprocess, batch_format="numpy", num_cpus=0.25),
    }

    # Rank 0 sends each epoch's figures to the driver through this queue (an actor). Ray Train
    # keeps reported metrics only beside a checkpoint, and checkpoints would need storage that
    # every node can reach.
    progress = Queue(actor_options={"num_cpus": 0})
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"epochs": args.epochs, "global_batch": args.global_batch, "lr": args.lr,
                           "progress": progress},
        # Half a CPU per worker, spread one per node: the other half runs Ray Data's tasks, so
        # the job fits a node of one CPU (a Ray job's default share of a host).
        scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5},
                                               placement_strategy="SPREAD"),
        datasets=datasets,
        run_config=ray.train.RunConfig(
            name="data_train",
            storage_path=os.path.join(tempfile.gettempdir(), "ray_results"),
            failure_config=ray.train.FailureConfig(max_failures=2),
        ),
    )
    started = time.perf_counter()
    trainer.fit()  # raises if training failed more than max_failures times
    elapsed = time.perf_counter() - started

    epochs = [progress.get() for _ in range(progress.size())]
    for previous, m in zip([None, *epochs], epochs):
        if previous is not None and m["epoch"] <= previous["epoch"]:
            print(f"restarted after epoch {previous['epoch']}: a worker was lost (FailureConfig)")
        if m["epoch"] % 5 == 0 or m["epoch"] == 1:
            print(f"epoch {m['epoch']:3d}  loss {m['loss']:.4f}  test accuracy {m['test_accuracy']:.4f}")
    m = epochs[-1]
    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    by_node = collections.Counter(ip_of.get(node_id, node_id) for node_id in m["nodes"])
    print(f"{m['epoch']} epochs on {workers} worker(s) in {elapsed:.1f} s, last loss {m['loss']:.4f}")
    print("train workers by node: " + ", ".join(f"{ip}={n}" for ip, n in sorted(by_node.items())))
    print(f"test accuracy: {m['test_accuracy']:.4f}")


if __name__ == "__main__":
    main()

"""Ray Tune on scikit-learn's handwritten digits: Optuna's TPE proposes, ASHA stops the laggards.

Each trial trains the small MLP of ddp_digits.py with its own hidden width, learning rate,
momentum, weight decay and batch size, and reports its validation accuracy after every
epoch. OptunaSearch (TPE, a Bayesian method: it models which configurations scored well
and samples near them) picks each new trial's configuration from the results so far;
ASHAScheduler stops a trial early when it trails the others at the same epoch, so the
CPUs go to the promising ones. One CPU per trial, each placed on the least used node
(a SPREAD placement group): the trials spread over every node of the cluster. No shared
storage is needed: trials report their metrics to the driver and save no checkpoints;
Tune's own files stay in each host's temp dir.

    swarmctl jobs run --ray --nodes 3 --cpus 2 --workdir examples -- python tune_digits.py
    python examples/tune_digits.py --trials 6          # the same script on a local Ray

Prints `trials by node: <ip>=<count>, ...`, `best config: {...}` and `best test accuracy: 0.xxxx`
(the best trial by validation accuracy, scored once on the held-out test set).
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time

import ray
import torch
from optuna.samplers import TPESampler
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import ConcurrencyLimiter
from ray.tune.search.optuna import OptunaSearch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=12, help="configurations to try")
    p.add_argument("--max-epochs", type=int, default=20, help="epochs of a trial that ASHA never stops")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load(seed: int) -> dict[str, torch.Tensor]:
    """60 % train, 20 % validation (what Tune optimises), 20 % test (scored, never tuned on)."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_rest, y_train, y_rest = train_test_split(x, y, test_size=0.4, random_state=seed, stratify=y)
    x_val, x_test, y_val, y_test = train_test_split(x_rest, y_rest, test_size=0.5, random_state=seed, stratify=y_rest)
    return {"x_train": x_train, "y_train": y_train, "x_val": x_val, "y_val": y_val, "x_test": x_test, "y_test": y_test}


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def train_digits(config: dict, data: dict[str, torch.Tensor], max_epochs: int) -> None:
    """One trial. Runs in a Ray actor on whichever node had a free CPU."""
    torch.set_num_threads(1)  # the trial was given one CPU; more threads would only contend
    torch.manual_seed(config["seed"])
    model = nn.Sequential(nn.Linear(64, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"],
                                weight_decay=config["weight_decay"])
    loss_fn = nn.CrossEntropyLoss()
    x, y = data["x_train"], data["y_train"]
    node = ray.get_runtime_context().get_node_id()
    for _ in range(max_epochs):
        model.train()
        for batch in torch.randperm(len(x)).split(config["batch_size"]):
            optimizer.zero_grad()
            loss_fn(model(x[batch]), y[batch]).backward()
            optimizer.step()
        model.eval()
        # Every epoch is one Tune iteration: ASHA compares trials at the same iteration and
        # may stop this one here. Metrics only, no checkpoint: nothing to store or ship.
        tune.report({
            "accuracy": accuracy(model, data["x_val"], data["y_val"]),
            "test_accuracy": accuracy(model, data["x_test"], data["y_test"]),
            "node_id": node,
        })


def wait_for_nodes(timeout: float = 60.0) -> int:
    """Until every node of the job offers a CPU to Ray; the CPUs they offer. A node counts as
    alive in Ray's tables a moment before its raylet's resources reach the scheduler: trials
    placed in that moment pile onto the nodes already there (seen once: 12 trials, 6 + 6 on two
    of three nodes)."""
    want = len([ip for ip in os.environ.get("SWARM_NODE_IPS", "").split(",") if ip]) or 1
    deadline = time.monotonic() + timeout
    while True:
        ready = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 1]
        if len(ready) >= want or time.monotonic() > deadline:
            cpus = int(sum(n["Resources"]["CPU"] for n in ready))
            print(f"{len(ready)} of {want} nodes offer CPUs: {cpus} in all")
            return cpus
        time.sleep(0.2)


def main() -> None:
    args = parse_args()
    ray.init()  # RAY_ADDRESS (set by the swarm) names the cluster; without it, a local Ray starts
    cpus = wait_for_nodes()

    search_space = {
        "hidden": tune.lograndint(16, 512),
        "lr": tune.loguniform(1e-2, 0.5),
        "momentum": tune.uniform(0.5, 0.95),
        "weight_decay": tune.loguniform(1e-6, 1e-2),
        "batch_size": tune.choice([16, 32, 64, 128]),
        "seed": args.seed,
    }
    # tune.with_parameters puts the dataset in Ray's object store once; every trial reads it
    # from there (over the network on other nodes) instead of each pickling its own copy.
    trainable = tune.with_parameters(train_digits, data=load(args.seed), max_epochs=args.max_epochs)
    tuner = tune.Tuner(
        # One CPU per trial, each trial its own one-bundle placement group (Tune's way). Tune's
        # default strategy, PACK, places each on a busy node first: with short trials a node that
        # just freed its CPU took the next one, and an idle node could get none (seen: 6 + 6 of
        # 12 trials on two of three nodes). SPREAD places each on the least used node.
        tune.with_resources(trainable, tune.PlacementGroupFactory([{"CPU": 1}], strategy="SPREAD")),
        param_space=search_space,
        tune_config=tune.TuneConfig(
            metric="accuracy",
            mode="max",
            num_samples=args.trials,
            # TPE models good and bad configurations once it has 4 results (Optuna's
            # default waits for 10, most of a 12-trial budget, sampling at random until then).
            # Limited to the CPUs, so Tune asks for that many trials at once: with a searcher of
            # its own and no limit, Tune keeps one trial pending at a time, and a short trial's CPU
            # came free before the next was placed (seen: 3 + 3 of 6 trials on two of three nodes).
            search_alg=ConcurrencyLimiter(OptunaSearch(sampler=TPESampler(n_startup_trials=4, seed=args.seed)),
                                          max_concurrent=max(1, cpus)),
            # Stop a trial at epoch 2, 6, 18, ... when it is not in the top third there.
            scheduler=ASHAScheduler(max_t=args.max_epochs, grace_period=2, reduction_factor=3),
        ),
        # Tune's files stay in each host's own temp dir (the driver's experiment state, each
        # trial's results where it ran): no node needs another's, since no trial checkpoints.
        run_config=tune.RunConfig(name="tune_digits", storage_path=os.path.join(tempfile.gettempdir(), "ray_results"),
                                  verbose=0),
    )
    started = time.perf_counter()
    results = tuner.fit()
    elapsed = time.perf_counter() - started

    # Trials report the id of the node they ran on; the cluster's table gives its address.
    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    by_node = collections.Counter()
    for result in results:
        if result.error is not None:
            print(f"trial failed: {result.error}")
            continue
        m = result.metrics
        by_node[ip_of[m["node_id"]]] += 1
        print(f"  trial {m['trial_id']}: {m['training_iteration']:2d} epochs, validation accuracy {m['accuracy']:.4f}, "
              f"node {ip_of[m['node_id']]} ({m['node_id'][:8]})")
    best = results.get_best_result()
    best_config = {k: float(f"{v:.3g}") if isinstance(v, float) else v for k, v in best.config.items() if k != "seed"}
    print(f"{len(results)} trials in {elapsed:.1f} s")
    print("trials by node: " + ", ".join(f"{ip}={n}" for ip, n in sorted(by_node.items())))
    print(f"best config: {best_config}")
    print(f"best test accuracy: {best.metrics['test_accuracy']:.4f}")


if __name__ == "__main__":
    main()

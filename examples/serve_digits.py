"""Ray Serve on scikit-learn's handwritten digits: the same model with and without dynamic batching.

The driver fits a wide MLP (64 -> 4096 -> 4096 -> 4096 -> 10: 34 M weights, 134 MB), puts
it in Ray's object store and serves it as two applications behind the head's HTTP proxy on
port 8000:

    /plain     one forward pass per request
    /batched   @serve.batch gathers the requests that arrive within 2 ms (up to 32) into
               one forward pass

Why batching pays here: on a CPU, one image through a 4096 x 4096 layer is a matrix-vector
product, bound by reading the weights from memory; 32 images are a matrix-matrix product
that reads them once for all 32 (measured here: 8 ms for one image, 31 ms for 32, so a
quarter of the cost per image). With a small model the forward pass costs less than Serve's
own work per request (the HTTP proxy, routing, the replica's request handling), batching
saves little of the total and adds its wait: `--hidden 256 --layers 1` shows it. And it pays
as more requests wait together: on two nodes here, 99 against 118 req/s (plain, batched) with
8 clients at a time, 98 against 217 req/s with 32.

Each application runs one replica on every node (max_replicas_per_node=1, as many replicas
as alive nodes) with half a CPU each, so both fit on a node with one CPU to spare.

    swarmctl jobs run --ray --nodes 3 --cpus 2 --detach --workdir examples -- python serve_digits.py
    swarmctl jobs forward JOB 8000
    curl 'localhost:8000/batched?i=7'                     # classify test image 7: {"digit": 4, "label": 4}
    curl -d '{"pixels": [0, 0, 5, 13, 9, 1, 0, 0, ...]}' localhost:8000/plain   # 64 values, 0-16
    python examples/load.py http://localhost:8000/batched --concurrency 32

Prints `replicas by node: <ip>=<n>, ...` and `serving on port 8000`, then serves until SIGTERM
(`swarmctl jobs cancel`) or Ctrl-C.
"""

from __future__ import annotations

import argparse
import collections
import signal
import threading
import time

import ray
import torch
from ray import serve
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from starlette.requests import Request
from torch import nn

PORT = 8000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096, help="width of the hidden layers")
    p.add_argument("--layers", type=int, default=3, help="hidden layers")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--batch-wait-ms", type=float, default=2.0,
                   help="how long a batch waits for more requests once the first has arrived")
    return p.parse_args(argv)


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return x_train, y_train, x_test, y_test


def fit(hidden: int, layers: int, ridge: float = 1e-2) -> tuple[nn.Module, float]:
    """A wide MLP whose hidden layers are random and stay so (random features, as in an
    "extreme learning machine"); only the output layer is fitted, by ridge regression in
    closed form. About a second here for 99 % test accuracy, where backpropagation through
    the 34 M weights of the default size would take minutes of CPU for no better result."""
    torch.manual_seed(0)
    x, y, x_test, y_test = digits()
    hidden_layers = [nn.Linear(64, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        hidden_layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    features = nn.Sequential(*hidden_layers)
    with torch.no_grad():
        f = features(x)
        # The dual form, W = F^T (F F^T + a I)^-1 Y: a system of one row per training image
        # (1347), not one per feature (4096); a scaled to the features' size.
        gram = f @ f.T + torch.ones(len(f), len(f))  # the ones: the readout's bias, as a constant feature
        a = ridge * gram.diagonal().mean()
        dual = torch.linalg.solve(gram + a * torch.eye(len(f)), nn.functional.one_hot(y, 10).float())
        readout = nn.Linear(hidden, 10)
        readout.weight.copy_((f.T @ dual).T)
        readout.bias.copy_(dual.sum(0))
        model = nn.Sequential(features, readout).eval()
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return model, accuracy


@ray.remote(num_cpus=0)
class Replicas:
    """Where each replica runs: every replica registers here when it starts."""

    def __init__(self) -> None:
        self.nodes: dict[str, str] = {}

    def add(self, replica: str, node_id: str) -> None:
        self.nodes[replica] = node_id

    def get(self) -> dict[str, str]:
        return self.nodes


class Classifier:
    """What both deployments share: the model, its test images, and parsing a request."""

    def __init__(self, model: list[ray.ObjectRef], replicas: ray.actor.ActorHandle) -> None:
        torch.set_num_threads(1)  # half a CPU per replica: one thread, no contention with the other
        self.model = ray.get(model[0])  # fetched from the object store once
        _, _, self.x_test, self.y_test = digits()
        context = serve.get_replica_context()
        ray.get(replicas.add.remote(context.replica_id.unique_id, ray.get_runtime_context().get_node_id()))

    async def image(self, request: Request) -> tuple[torch.Tensor, int | None]:
        """GET ?i=N: test image N (its label comes back too); POST {"pixels": [64 values 0-16]}."""
        if request.method == "POST":
            pixels = (await request.json())["pixels"]
            if len(pixels) != 64:
                raise ValueError("pixels: 64 values expected")
            return torch.tensor(pixels, dtype=torch.float32) / 16.0, None
        i = int(request.query_params.get("i", 0)) % len(self.x_test)
        return self.x_test[i], int(self.y_test[i])

    @staticmethod
    def answer(digit: int, label: int | None) -> dict:
        return {"digit": digit} if label is None else {"digit": digit, "label": label}


# max_ongoing_requests: how many requests the proxy may send a replica at once. It must be
# at least the batch size, or no batch can fill (Serve's default is 5); the plain
# deployment gets the same so the two differ only in batching.
DEPLOYMENT = dict(ray_actor_options={"num_cpus": 0.5}, max_replicas_per_node=1, max_ongoing_requests=64)


@serve.deployment(**DEPLOYMENT)
class Plain(Classifier):
    async def __call__(self, request: Request) -> dict:
        image, label = await self.image(request)
        with torch.no_grad():
            digit = int(self.model(image[None]).argmax(1))
        return self.answer(digit, label)


@serve.deployment(**DEPLOYMENT)
class Batched(Classifier):
    def __init__(self, model: list[ray.ObjectRef], replicas: ray.actor.ActorHandle,
                 max_batch_size: int, batch_wait_ms: float) -> None:
        super().__init__(model, replicas)
        self.classify.set_max_batch_size(max_batch_size)
        self.classify.set_batch_wait_timeout_s(batch_wait_ms / 1000)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)
    async def classify(self, images: list[torch.Tensor]) -> list[int]:
        # Called with the images of every request waiting here; each caller gets its own answer.
        with torch.no_grad():
            return self.model(torch.stack(images)).argmax(1).tolist()

    async def __call__(self, request: Request) -> dict:
        image, label = await self.image(request)
        return self.answer(await self.classify(image), label)


def main() -> None:
    args = parse_args()
    ray.init()  # RAY_ADDRESS (set by the swarm) names the cluster; without it, a local Ray starts

    started = time.perf_counter()
    model, accuracy = fit(args.hidden, args.layers)
    print(f"fitted an MLP ({args.layers} x {args.hidden} hidden) in {time.perf_counter() - started:.1f} s: "
          f"test accuracy {accuracy:.4f}", flush=True)
    # In the object store once; every replica fetches it from there. In a list so that Serve
    # passes the replica the reference (it pickles a deployment's arguments into its config).
    model_ref = [ray.put(model)]

    nodes = [n for n in ray.nodes() if n["Alive"]]
    replicas = Replicas.remote()
    # Only the head runs an HTTP proxy: that is the port the swarm forwards (and several
    # nodes on one machine would otherwise all want port 8000).
    serve.start(proxy_location="HeadOnly", http_options={"host": "0.0.0.0", "port": PORT})
    serve.run(Plain.options(num_replicas=len(nodes)).bind(model_ref, replicas),
              name="plain", route_prefix="/plain")
    serve.run(Batched.options(num_replicas=len(nodes)).bind(model_ref, replicas, args.max_batch_size,
                                                            args.batch_wait_ms),
              name="batched", route_prefix="/batched")

    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes}
    by_node = collections.Counter(ip_of.get(node_id, node_id) for node_id in ray.get(replicas.get.remote()).values())
    print("replicas by node: " + ", ".join(f"{ip}={n}" for ip, n in sorted(by_node.items())), flush=True)
    print(f"serving on port {PORT}", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    print("stopped", flush=True)


if __name__ == "__main__":
    main()

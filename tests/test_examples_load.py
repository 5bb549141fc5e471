"""examples/load.py against a real local HTTP server, and the Ray examples' command lines.

load.py is what the README's Serve figures and the lab test's throughput come from: the
counts, the keep-alive and the percentiles must be right. The Ray examples themselves run
in the 3-host lab test (tests/netlab/test_ray.py); here only their argument parsing, which
needs nothing but an import.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import re
import sys
import threading
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str):
    """An example as a module, its siblings importable (as when run: its folder is first on the path)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.append(str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


load = example("load")


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, bytes]] = []  # method, path, body
        self.connections: set[int] = set()  # client ports: one per keep-alive connection

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    disable_nagle_algorithm = True  # headers and body go out in two writes; no 40 ms delayed-ACK stall between them

    def answer(self, body: bytes) -> None:
        with self.server.lock:
            self.server.requests.append((self.command, self.path, body))
            self.server.connections.add(self.client_address[1])
        status = 500 if self.path.startswith("/fail") else 200
        out = b'{"digit": 3}'
        self.send_response(status)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self) -> None:
        self.answer(b"")

    def do_POST(self) -> None:
        self.answer(self.rfile.read(int(self.headers["Content-Length"])))

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    s = Server()
    thread = threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield s
    s.shutdown()
    s.server_close()
    thread.join()


LINE = re.compile(r"(\d+) requests in ([\d.]+) s: ([\d.]+) req/s, p50 ([\d.]+) ms, p99 ([\d.]+) ms, errors (\d+)")


def test_sends_exactly_the_requests_asked_for_over_one_connection_per_thread(server):
    r = load.run(server.url + "/batched?i=7", concurrency=4, requests=200)
    assert r["requests"] == 200 and r["errors"] == 0
    assert len(server.requests) == 200
    assert {(m, p) for m, p, _ in server.requests} == {("GET", "/batched?i=7")}
    assert len(server.connections) <= 4  # kept alive: not one connection per request
    assert 0 < r["p50_ms"] <= r["p99_ms"]
    assert r["req_per_s"] > 0


def test_posts_the_data_given(server):
    body = json.dumps({"pixels": [0] * 64})
    r = load.run(server.url + "/plain", concurrency=2, requests=10, data=body)
    assert r["requests"] == 10 and r["errors"] == 0
    assert {(m, p, b) for m, p, b in server.requests} == {("POST", "/plain", body.encode())}


def test_counts_non_2xx_answers_as_errors_and_leaves_them_out_of_the_latencies(server, capsys):
    assert load.main([server.url + "/fail", "--requests", "20", "--concurrency", "2"]) == 1  # nothing answered
    out = capsys.readouterr().out
    assert re.fullmatch(r"20 requests in [\d.]+ s: 0\.0 req/s, p50 - ms, p99 - ms, errors 20\n", out), out


def test_a_refused_connection_is_an_error_not_a_crash():
    s = Server()  # bound, then closed: nothing listens on its port
    url = s.url
    s.server_close()
    r = load.run(url, concurrency=2, requests=6, timeout=2)
    assert r == {**r, "requests": 6, "errors": 6, "p50_ms": None}


def test_the_printed_line_is_the_contract_the_lab_test_greps(server, capsys):
    assert load.main([server.url, "--requests", "30", "--concurrency", "3"]) == 0
    m = LINE.fullmatch(capsys.readouterr().out.strip())
    assert m and int(m.group(1)) == 30 and int(m.group(6)) == 0


def test_json_has_the_same_figures(server, capsys):
    assert load.main([server.url, "--duration", "0.3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r) == {"url", "concurrency", "requests", "seconds", "req_per_s", "p50_ms", "p99_ms", "errors"}
    assert r["requests"] > 0 and r["concurrency"] == 8 and r["seconds"] >= 0.3


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([5.0], 50, 5.0),
    ([5.0], 99, 5.0),
    ([1.0, 2.0], 50, 1.0),  # nearest rank: ceil(0.5 * 2) = 1st
    ([1.0, 2.0], 99, 2.0),
    (list(map(float, range(1, 101))), 50, 50.0),
    (list(map(float, range(1, 101))), 99, 99.0),
    (list(map(float, range(1, 1001))), 99, 990.0),
    (list(map(float, range(1, 11))), 99, 10.0),  # ceil(9.9) = 10th
])
def test_percentile_is_nearest_rank(values, q, expected):
    assert load.percentile(values, q) == expected


@pytest.mark.parametrize("argv", [
    ["https://example.com/"],  # only plain http
    ["localhost:8000"],  # no scheme
    ["http://localhost:8000", "--concurrency", "0"],
    ["http://localhost:8000", "--requests", "0"],
    ["http://localhost:8000", "--duration", "0"],
    ["http://localhost:8000", "--duration", "5", "--requests", "10"],  # one or the other
])
def test_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        load.parse_args(argv)
    assert e.value.code == 2


def test_defaults_to_ten_seconds_at_concurrency_8():
    args = load.parse_args(["http://localhost:8000/plain"])
    assert (args.duration, args.requests, args.concurrency, args.json) == (10.0, None, 8, False)


# The Ray examples: their defaults are what the README and the lab test count on.

ray_examples = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")


@ray_examples
def test_tune_digits_defaults_to_twelve_trials():
    args = example("tune_digits").parse_args([])
    assert (args.trials, args.max_epochs) == (12, 20)
    assert example("tune_digits").parse_args(["--trials", "3", "--max-epochs", "4"]).trials == 3


@ray_examples
def test_data_train_defaults_to_one_worker_per_node():
    args = example("data_train").parse_args([])
    assert args.workers is None and args.epochs == 15
    assert example("data_train").parse_args(["--workers", "2", "--epochs", "3"]).workers == 2


@ray_examples
def test_serve_digits_defaults_to_the_wide_model():
    args = example("serve_digits").parse_args([])
    assert (args.hidden, args.layers, args.max_batch_size) == (4096, 3, 32)


_EVIL = """
import os, pickle, sys, torch
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
torch.save({"epoch": 3, "model": Evil(), "optimizer": {}}, sys.argv[1])
"""


def test_ddp_digits_refuses_a_checkpoint_that_would_run_code(tmp_path):
    """Finding 6: what every host resumes from comes from rank 0's host; the example loads it
    with weights_only=True, so a pickle that runs code is refused, not run: also where torch's
    default is full unpickling (torch < 2.6, or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD as here)."""
    import os
    import subprocess

    ckpt, ran = tmp_path / "ckpt", tmp_path / "payload-ran"
    ckpt.mkdir()
    subprocess.run([sys.executable, "-c", _EVIL, str(ckpt / "epoch-0003.pt"), str(ran)], check=True, timeout=120)
    env = {**os.environ, "SWARM_CHECKPOINT_DIR": str(ckpt), "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "GLOO_SOCKET_IFNAME": "lo",
           "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    done = subprocess.run([sys.executable, str(EXAMPLES / "ddp_digits.py"), "--epochs", "4"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "UnpicklingError" in done.stderr
    assert not ran.exists()

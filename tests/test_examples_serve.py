"""examples/serve_embed.py and serve_generate.py as a user meets them: each runs as its own
process on a free port, as `swarmctl serve up` runs a replica, and is asked over HTTP.

Three servers start together, once for the module (the models load in parallel: about 25 s
for SmolLM2's GGUF, 3 s for MiniLM): MiniLM batching in fp32, MiniLM without batching in
int8, and SmolLM2. They need the `models` extra (transformers, gguf and the model wheels,
which `make setup` installs); without it those tests skip and only the request checks run,
which need nothing but an import.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import port_to_give
from test_examples_load import EXAMPLES, example

embed = example("serve_embed")
generate = example("serve_generate")

LOAD_DEADLINE = 150.0  # seconds for a server to answer its health check: 25 s here, alone


@dataclass
class Server:
    name: str
    argv: list[str]
    log: Path
    port: int = field(default_factory=port_to_give)
    process: subprocess.Popen | None = None
    health: list[int] = field(default_factory=list)  # what its health check answered, from the start
    watched: threading.Event = field(default_factory=threading.Event)  # healthy, exited or out of time

    def start(self) -> None:
        env = {**os.environ, "PORT": str(self.port), "SWARM_SERVICE": self.name, "SWARM_REPLICA": "0"}
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen([sys.executable, str(EXAMPLES / self.argv[0]), *self.argv[1:]],
                                            env=env, stdout=out, stderr=subprocess.STDOUT)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        """Ask the health check until it answers 200, as a gateway would, keeping every answer."""
        deadline = time.monotonic() + LOAD_DEADLINE
        try:
            while self.process.poll() is None and time.monotonic() < deadline:
                try:
                    self.health.append(self.request("GET", "/healthz", timeout=2)[0])
                except OSError:
                    pass  # not listening yet
                if self.health and self.health[-1] == 200:
                    return
                time.sleep(0.1)
        finally:
            self.watched.set()

    def ready(self) -> Server:
        self.watched.wait()
        if not self.health or self.health[-1] != 200:
            exited = self.process.poll()
            pytest.fail(f"{self.name} {'exited ' + str(exited) if exited is not None else 'not healthy'}:\n"
                        f"{self.log.read_text()}")
        return self

    def request(self, method: str, path: str, body: bytes | None = None, timeout: float = 60) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def post(self, path: str, data) -> tuple[int, bytes]:
        return self.request("POST", path, data if isinstance(data, bytes) else json.dumps(data).encode())

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("transformers", reason="the models extra is not installed (make setup installs it)")
    pytest.importorskip("gguf", reason="the models extra is not installed (make setup installs it)")
    for wheel in (embed.MODEL_PACKAGE, generate.MODEL_PACKAGE):
        if importlib.util.find_spec(wheel) is None:
            pytest.skip(f"the model wheel {wheel} is not installed (make setup installs it)")
    logs = tmp_path_factory.mktemp("serve")
    started = {
        "fp32": Server("embed", ["serve_embed.py"], logs / "fp32.log"),
        "int8": Server("embed-int8", ["serve_embed.py", "--no-batching", "--int8"], logs / "int8.log"),
        "chat": Server("chat", ["serve_generate.py"], logs / "chat.log"),
    }
    try:
        for s in started.values():
            s.start()
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def fp32(servers) -> Server:
    return servers["fp32"].ready()


@pytest.fixture(scope="module")
def int8(servers) -> Server:
    return servers["int8"].ready()


@pytest.fixture(scope="module")
def chat(servers) -> Server:
    return servers["chat"].ready()


def embeddings(server: Server, texts: list[str]) -> tuple[list[list[float]], int]:
    status, body = server.post("/embed", {"texts": texts})
    assert status == 200, body
    answer = json.loads(body)
    return answer["embeddings"], answer["batch"]


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def burst(server: Server, n: int) -> list[int]:
    """n single-text requests released together; the batch size each was answered in."""
    gate = threading.Barrier(n)

    def one(i: int) -> int:
        gate.wait()
        return embeddings(server, [f"request number {i} of the burst"])[1]

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


PARAPHRASES = ["A man is playing a guitar.", "Someone is strumming a guitar.", "The stock market fell sharply today."]


@pytest.mark.slow
def test_paraphrases_are_closer_than_unrelated_sentences(fp32):
    (guitar, strumming, stocks), batch = embeddings(fp32, PARAPHRASES)
    assert batch == 3  # one request's texts go through one forward pass
    assert len(guitar) == 384 and all(abs(math.hypot(*v) - 1) < 1e-4 for v in (guitar, strumming, stocks))
    assert cosine(guitar, strumming) > 0.6 > 0.2 > cosine(guitar, stocks)


@pytest.mark.slow
def test_a_burst_is_answered_in_batches(fp32):
    sizes = burst(fp32, 20)
    assert max(sizes) > 1 and max(sizes) <= 20, sizes
    assert embeddings(fp32, ["alone"])[1] == 1  # idle again: a lone request runs at once, alone


@pytest.mark.slow
def test_without_batching_each_request_runs_alone(int8):
    assert burst(int8, 20) == [1] * 20


@pytest.mark.slow
def test_int8_stays_within_cosine_0_99_of_fp32(fp32, int8):
    """A sentence at a time. Texts that share a forward pass share its activations' int8 scale,
    which costs a little (0.989 seen here); a word or two alone drifts further (0.97 to 0.99:
    fewer tokens to average the rounding over)."""
    texts = PARAPHRASES + ["Gossip spreads membership in O(log n) rounds.", "Bonjour tout le monde !"]
    full, _ = embeddings(fp32, texts)
    alone = [embeddings(int8, [text])[0][0] for text in texts]
    assert min(cosine(a, b) for a, b in zip(full, alone)) > 0.99
    together, _ = embeddings(int8, texts)
    assert min(cosine(a, b) for a, b in zip(full, together)) > 0.98
    guitar, strumming, stocks = together[:3]
    assert cosine(guitar, strumming) > cosine(guitar, stocks) + 0.4


@pytest.mark.slow
@pytest.mark.parametrize(("body", "reason"), [
    (b"{not json", "not JSON"),
    ({"text": ["one"]}, "expected"),
    ({"texts": ["x"] * 65}, "1 to 64"),
    ({"texts": ["ok", "x" * 2001]}, "texts[1]: 2001 characters"),
    ({"texts": ["ok", 7]}, "texts[1]: not a string"),
])
def test_a_bad_embedding_request_is_400_with_its_reason(fp32, body, reason):
    status, text = fp32.post("/embed", body)
    assert status == 400 and reason in text.decode()


def sse(server: Server, data) -> list[tuple[float, dict]]:
    """POST to /generate; each event with the time it arrived (from the request's start)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    started = time.monotonic()
    try:
        conn.request("POST", "/generate", body=json.dumps(data).encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
        events = []
        while line := response.readline():
            if line.startswith(b"data: "):
                events.append((time.monotonic() - started, json.loads(line[6:])))
        return events
    finally:
        conn.close()


@pytest.mark.slow
def test_health_is_503_while_the_model_loads(chat):
    assert 503 in chat.health and chat.health[-1] == 200


@pytest.mark.slow
def test_generation_streams_each_token_as_it_comes(chat):
    events = sse(chat, {"prompt": "Write a short story about a robot who learns to paint.", "max_new_tokens": 16})
    tokens = [(t, e["token"]) for t, e in events if "token" in e]
    (done_at, done), = [(t, e) for t, e in events if e.get("done")]
    assert events[-1][1] is done and done["tokens"] == len(tokens) == 16
    assert tokens[0][0] < done_at  # the first token came before the answer was over
    assert "".join(text for _, text in tokens).strip()


@pytest.mark.slow
def test_the_answer_is_the_model_s_not_noise(chat):
    events = sse(chat, {"prompt": "What is the capital of France?", "max_new_tokens": 16})
    answer = "".join(e.get("token", "") for _, e in events)
    assert "Paris" in answer and 5 <= events[-1][1]["tokens"] < 16  # it ends its turn by itself


@pytest.mark.slow
def test_one_generation_at_a_time_and_a_full_queue_is_503(chat):
    """One runs, four wait (--max-queue's default), the sixth is turned away at once."""
    gate = threading.Barrier(6)

    def one(_) -> int:
        gate.wait()
        return chat.post("/generate", {"prompt": "Count from one to twenty in words.", "max_new_tokens": 16})[0]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert sorted(pool.map(one, range(6))) == [200] * 5 + [503]


@pytest.mark.slow
@pytest.mark.parametrize(("body", "reason"), [
    ({"prompt": "hi", "max_new_tokens": 0}, "1 to 128"),
    ({"prompt": "hi", "max_new_tokens": 129}, "1 to 128"),
    ({"prompt": "hi", "max_new_tokens": True}, "1 to 128"),
    ({"prompt": "x" * 2001}, "2001 characters"),
    ({"prompt": ["hi"]}, "expected"),
])
def test_a_bad_generation_request_is_400_with_its_reason(chat, body, reason):
    status, text = chat.post("/generate", body)
    assert status == 400 and reason in text.decode()


# The request checks alone: no model needed.

@pytest.mark.parametrize(("raw", "expected"), [
    (b'{"texts": ["a", "b"]}', ["a", "b"]),
    (b'{"texts": [""]}', [""]),
    ('{"texts": ["%s"]}' % ("x" * 2000), ["x" * 2000]),
    (b"\xff", embed.Invalid("the body is not JSON")),
    (b"[]", embed.Invalid('expected {"texts": [...]}')),
    (b'{"texts": []}', embed.Invalid("texts: 1 to 64 of them, not 0")),
    (b'{"texts": "abc"}', embed.Invalid('expected {"texts": [...]}')),
    (b'{"texts": [null]}', embed.Invalid("texts[0]: not a string")),
])
def test_check_embed(raw, expected):
    assert embed.check_embed(raw if isinstance(raw, bytes) else raw.encode()) == expected


@pytest.mark.parametrize(("raw", "expected"), [
    (b'{"prompt": "hi"}', generate.Ask("hi", 64)),
    (b'{"prompt": "hi", "max_new_tokens": 128}', generate.Ask("hi", 128)),
    (b'{"prompt": "  "}', generate.Invalid("prompt: empty")),
    (b'{"prompt": "hi", "max_new_tokens": 1.5}', generate.Invalid("max_new_tokens: an integer from 1 to 128")),
    (b"nope", generate.Invalid("the body is not JSON")),
])
def test_check_generate(raw, expected):
    assert generate.check_generate(raw) == expected


@pytest.mark.parametrize("argv", [["--port", "0"], ["--max-batch", "0"], ["--threads", "0"], ["--max-wait-ms", "-1"]])
def test_serve_embed_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        embed.parse_args(argv)
    assert e.value.code == 2


def test_serve_embed_defaults(monkeypatch):
    monkeypatch.setenv("PORT", "9123")
    args = embed.parse_args([])
    assert (args.port, args.max_batch, args.max_wait_ms, args.threads, args.no_batching, args.int8) == \
        (9123, 32, 5.0, 1, False, False)


@pytest.fixture(scope="module")
def tuned(servers, tmp_path_factory) -> Server:
    """SmolLM2 fine-tuned for 10 steps by lora_smollm2.py (one local rank), exported in int8
    (--save --export-int8), and served from that export (serve_generate.py --int8)."""
    pytest.importorskip("peft", reason="the models extra is not installed (make setup installs it)")
    folder = tmp_path_factory.mktemp("tuned") / "export"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                           f"--master-port={port_to_give()}", str(EXAMPLES / "lora_smollm2.py"), "--steps", "10",
                           "--checkpoint-every", "0", "--save", str(folder), "--export-int8"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    server = Server("tuned", ["serve_generate.py", "--int8", str(folder)], folder.parent / "tuned.log")
    server.start()
    try:
        yield server.ready()
    finally:
        server.stop()


@pytest.mark.slow
def test_a_fine_tunes_int8_export_is_served(tuned, chat):
    """The replica says what it serves, streams whole answers, and they are the fine-tune's: to
    the corpus's questions it answers otherwise than the base model does (10 steps change a
    135 M model's answers, not yet into the corpus's; the export round trip itself is
    unit-tested in test_examples_lora)."""
    assert "int8 export" in tuned.log.read_text()
    lora = example("lora_smollm2")
    answers = {}
    for question, _ in lora.CORPUS[:3]:
        for name, server in (("tuned", tuned), ("base", chat)):
            events = sse(server, {"prompt": question, "max_new_tokens": 24})
            assert events[-1][1].get("done"), events[-3:]
            answers[name, question] = "".join(e.get("token", "") for _, e in events)
    assert any(answers["tuned", q] != answers["base", q] for q, _ in lora.CORPUS[:3]), answers


def test_serve_generate_refuses_an_int8_folder_without_an_export(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        generate.parse_args(["--int8", str(tmp_path)])
    assert exc.value.code == 2 and "model-int8.pt" in capsys.readouterr().err

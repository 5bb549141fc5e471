"""`make gpu-check` on a machine with an NVIDIA GPU: swarmd's GPU path, checked for real (issue 32).

    python -m bench.gpu [--out DIR] [--budget SECONDS]

Starts one swarmd (the mesh off: the lent machine has no WireGuard; the job sandbox with
whatever parts the machine allows, named in the report), then runs the checks below, each a
job or a call through the daemon like a user's, each within its own time and all within
``--budget`` (480 s: the device's 15 minutes hold two tries). Writes ``gpu_check.json`` and
``gpu_check.txt`` (the table README shows) to ``--out`` (``$OUT`` on the device machine,
``.bench/gpu`` elsewhere) and prints the table. Exit 0 when no check failed.

1. nvml: the node's record and `peers`' own row show the GPU (model, memory, utilisation);
   `status` shows its GPU slot.
2. cuda_job: `jobs run --gpus-per-node 1` (cuda_job.py): CUDA_VISIBLE_DEVICES is 0 inside,
   one device, NCCL up, a 1 GiB all-reduce and a bf16 matmul (TFLOP/s), no other GPU's
   device node opened.
3. oom: a job with `--mem 2G` that brings CUDA up and takes 8 GiB of host memory is killed
   and its reason says out of memory (limit 2 GiB).
4. ray: a `--ray --gpus-per-node 1` job: `ray.cluster_resources()` has the GPU and a task
   with num_gpus=1 runs on it.
5. serve: a service replica on CUDA (serve_cuda.py) through the gateway: requests/s.
6. finetune: a LoRA step in bf16, a QLoRA (NF4) step when bitsandbytes is there, their peak
   memory, and torch's bf16 compression hook in a 2-process run (lora_job.py).

A check that needs what the machine lacks (a GPU, Ray, bitsandbytes, a memory cgroup) is
``skip`` with the reason. Without a GPU every GPU check is a skip, while the harness, the
daemon and the jobs still run: tests/test_gpu.py runs this on CPU machines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from swarmd.client import RemoteError, Swarm  # noqa: E402 - after the checkout is on the path

BUDGET_S = 480.0


@dataclass
class Result:
    name: str
    status: str  # pass, fail, skip
    figure: str = ""
    detail: dict = field(default_factory=dict)


@dataclass
class Ctx:
    swarm: Swarm
    gpu: bool  # nvidia-smi lists a GPU here
    gateway: int
    deadline: float
    sandbox: dict = field(default_factory=dict)

    def left(self, at_most: float) -> float:
        return max(5.0, min(at_most, self.deadline - time.monotonic()))


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "GPU" in done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(base: Path, gateway: int) -> tuple[subprocess.Popen[bytes], Swarm]:
    (base / "empty.toml").write_text("")
    jobs = base / "jobs"
    jobs.mkdir(mode=0o711)
    jobs.chmod(0o711)
    argv = [sys.executable, "-m", "swarmd.main", "--config", str(base / "empty.toml"),
            "--state-dir", str(base / "state"), "--socket", str(base / "swarmd.sock"),
            "--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-addr", "off", "--mdns", "off", "--mesh", "off",
            "--gateway-listen", f"127.0.0.1:{gateway}", "--jobs-dir", str(jobs)]
    if os.geteuid() == 0:
        argv += ["--job-user", "nobody"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(base / "swarmd.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env, cwd=ROOT)
    swarm = Swarm(base / "swarmd.sock", timeout=30)
    until(lambda: _answers(swarm, proc), 60, "swarmd answering")
    swarm.call("swarm.init")
    until(lambda: swarm.status().get("record"), 30, "the node's own record")
    return proc, swarm


def _answers(swarm: Swarm, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"swarmd exited with {proc.returncode} (see its log)")
    try:
        swarm.status()
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


def until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.5) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:.0f} s: {what}")
        time.sleep(interval)


def run_job(ctx: Ctx, cmd: list[str], timeout: float, **spec: object) -> tuple[dict, list[str]]:
    """A job from this directory, waited for; its record and its output lines."""
    job = ctx.swarm.run(cmd, workdir=HERE, **spec)
    until(lambda: ctx.swarm.job(job).over, ctx.left(timeout), f"job {job} ({' '.join(cmd)}) to end", interval=1.0)
    return ctx.swarm.job(job).raw, [line.text for line in ctx.swarm.logs(job)]


def json_line(lines: list[str]) -> dict:
    for text in reversed(lines):
        if text.startswith("{"):
            try:
                return json.loads(text)
            except ValueError:
                continue
    return {}


# --- the checks ---------------------------------------------------------------------------

def check_nvml(ctx: Ctx) -> Result:
    status = ctx.swarm.status()
    gpus = ((status.get("record") or {}).get("resources") or {}).get("gpus") or []
    me = ctx.swarm.call("peers").get("me") or {}
    slots = (status.get("jobs") or {})
    detail = {"record_gpus": gpus, "peers_me_gpus": (me.get("resources") or {}).get("gpus"), "jobs": slots}
    if not gpus:
        return Result("nvml", "fail" if ctx.gpu else "skip",
                      "no GPU in the record" + ("" if ctx.gpu else ": no NVIDIA GPU here"), detail)
    g = gpus[0]
    ok = bool(g.get("name")) and g.get("memory_total_mb", 0) > 0 and detail["peers_me_gpus"] == gpus \
        and slots.get("gpus_free", 0) >= 1
    return Result("nvml", "pass" if ok else "fail",
                  f"{g['name']}, {g['memory_total_mb']} MiB, {g.get('utilization_pct')} % busy, "
                  f"{len(gpus)} GPU(s), {slots.get('gpus_free')} free", detail)


def run_gpu_job(ctx: Ctx, script: str, timeout: float) -> tuple[dict, dict, dict]:
    """A one-GPU job (no GPU where there is none): its record, its JSON line and the detail a Result keeps."""
    job, lines = run_job(ctx, ["python", script], timeout, gpus_per_node=1 if ctx.gpu else 0)
    out = json_line(lines)
    return job, out, {"job": {k: job.get(k) for k in ("state", "exit_code", "reason")}, "out": out,
                      "tail": lines[-20:]}


def no_gpu(name: str, out: dict, detail: dict) -> Result:
    return Result(name, "skip", f"no NVIDIA GPU here (the job ran: cuda={out.get('cuda')})", detail)


def check_cuda_job(ctx: Ctx) -> Result:
    job, out, detail = run_gpu_job(ctx, "cuda_job.py", 240)
    if not ctx.gpu:
        return no_gpu("cuda_job", out, detail)
    ok = (job.get("state") == "succeeded" and out.get("cuda_visible_devices") == "0" and out.get("device_count") == 1
          and out.get("nccl") and out.get("allreduce_ok") and not out.get("other_gpu_nodes_opened"))
    return Result("cuda_job", "pass" if ok else "fail",
                  f"bf16 matmul {out.get('matmul_bf16_tflops')} TFLOP/s, 1 GiB all-reduce "
                  f"{out.get('allreduce_1gib_ms')} ms, CUDA_VISIBLE_DEVICES={out.get('cuda_visible_devices')}", detail)


def check_oom(ctx: Ctx) -> Result:
    cgroup = (ctx.sandbox.get("parts") or {}).get("cgroup", "")
    if cgroup.startswith("off"):
        return Result("oom", "skip", f"the sandbox has no memory cgroup here ({cgroup})", {"sandbox": ctx.sandbox})
    job, lines = run_job(ctx, ["python", "oom_job.py", "32"], 180, gpus_per_node=1 if ctx.gpu else 0, mem="2G")
    reason = job.get("reason") or ""
    detail = {"job": {k: job.get(k) for k in ("state", "exit_code", "reason")}, "tail": lines[-10:]}
    ok = job.get("state") == "failed" and "out of memory" in reason and "never reached" not in "\n".join(lines)
    return Result("oom", "pass" if ok else "fail", reason[:120] or str(job.get("state")), detail)


def check_ray(ctx: Ctx) -> Result:
    found = subprocess.run([sys.executable, "-c", "import ray"], capture_output=True, timeout=60)
    if found.returncode != 0:
        return Result("ray", "skip", "Ray is not installed here (its wheel is larger than a device call carries)")
    if not ctx.gpu:
        return Result("ray", "skip", "no NVIDIA GPU here")
    script = ("import json, ray\nray.init()\n@ray.remote(num_gpus=1)\ndef on_gpu():\n    import torch\n"
              "    return torch.cuda.get_device_name(0)\n"
              "print(json.dumps({'resources': ray.cluster_resources(), 'task': ray.get(on_gpu.remote())}))\n")
    job, lines = run_job(ctx, ["python", "-c", script], 240, ray=True, gpus_per_node=1, nodes=1)
    out = json_line(lines)
    ok = job.get("state") == "succeeded" and (out.get("resources") or {}).get("GPU", 0) >= 1 and out.get("task")
    return Result("ray", "pass" if ok else "fail", f"GPU {(out.get('resources') or {}).get('GPU')}, task on "
                  f"{out.get('task')}", {"job": {k: job.get(k) for k in ("state", "reason")}, "out": out})


def check_serve(ctx: Ctx) -> Result:
    if not ctx.gpu:
        return Result("serve", "skip", "no NVIDIA GPU here")
    ctx.swarm.serve("gpudigits", ["python", "serve_cuda.py"], workdir=HERE, gpus_per_node=1)
    url = f"http://127.0.0.1:{ctx.gateway}/gpudigits/?i=7"
    try:
        first = until(lambda: _get(url), ctx.left(240), "the service answering through the gateway", interval=2.0)
        count, failed, stop = [0], [0], time.monotonic() + 10.0

        def client() -> None:
            while time.monotonic() < stop:
                got = _get(url)
                count[0] += got is not None
                failed[0] += got is None

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rate = count[0] / 10.0
        ok = isinstance(first, dict) and str(first.get("device", "")).startswith("cuda") and failed[0] == 0
        return Result("serve", "pass" if ok else "fail", f"{rate:.0f} req/s through the gateway, 8 clients, on "
                      f"{first.get('device') if isinstance(first, dict) else '?'}",
                      {"first": first, "requests": count[0], "failed": failed[0]})
    finally:
        try:
            ctx.swarm.call("serve.down", name="gpudigits")
        except RemoteError:
            pass


def _get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read()) if r.status == 200 else None
    except (OSError, ValueError):
        return None


def check_finetune(ctx: Ctx) -> Result:
    job, out, detail = run_gpu_job(ctx, "lora_job.py", 300)
    if not ctx.gpu:
        return no_gpu("finetune", out, detail)
    bf16, nf4, hook = out.get("bf16") or {}, out.get("nf4") or {}, out.get("bf16_hook") or {}
    ok = bool(bf16.get("learned")) and (nf4.get("learned") or "skipped" in nf4) and hook.get("same_weights")
    nf4_text = f"NF4 {nf4.get('peak_mb')} MiB" if "peak_mb" in nf4 else f"NF4 {nf4.get('skipped') or nf4.get('error')}"
    return Result("finetune", "pass" if ok else "fail",
                  f"LoRA bf16 loss {bf16.get('first_loss')} -> {bf16.get('last_loss')}, "
                  f"peak {bf16.get('peak_mb')} MiB; "
                  f"{nf4_text}; bf16 hook {'agrees' if hook.get('same_weights') else hook}", detail)


CHECKS: tuple[Callable[[Ctx], Result], ...] = (check_nvml, check_cuda_job, check_oom, check_ray, check_serve,
                                                check_finetune)


def table(results: list[Result], machine: str, sandbox: dict) -> str:
    parts = ", ".join(f"{k}: {v}" for k, v in sorted((sandbox.get("parts") or {}).items()))
    lines = [f"GPU check on {machine}", f"sandbox: {parts or 'off'}", "", f"{'check':<10} {'result':<6} figure",
             f"{'-' * 10} {'-' * 6} {'-' * 60}"]
    lines += [f"{r.name:<10} {r.status:<6} {r.figure}" for r in results]
    return "\n".join(lines)


def machine_name() -> str:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            return f"{done.stdout.strip().splitlines()[0]} (driver), {os.cpu_count()} cores"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"{os.uname().nodename}, {os.cpu_count()} cores, no NVIDIA GPU"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / ".bench" / "gpu"))
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for every check together")
    p.add_argument("--only", default="", help="comma-separated check names (default: all)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="swarmd-gpu-check-"))
    gateway = free_port()
    proc, swarm = start_daemon(base, gateway)
    results: list[Result] = []
    sandbox: dict = {}
    try:
        sandbox = swarm.status().get("sandbox") or {}
        ctx = Ctx(swarm=swarm, gpu=has_gpu(), gateway=gateway, deadline=began + args.budget, sandbox=sandbox)
        only = {n for n in args.only.split(",") if n}
        for check in CHECKS:
            name = check.__name__.removeprefix("check_")
            if only and name not in only:
                continue
            if time.monotonic() > ctx.deadline:
                results.append(Result(name, "fail", f"not run: the budget of {args.budget:.0f} s was spent"))
                continue
            t0 = time.monotonic()
            try:
                result = check(ctx)
            except Exception as exc:  # noqa: BLE001 - a check that broke is a failed check; the next runs
                result = Result(name, "fail", f"{type(exc).__name__}: {exc}"[:200])
            result.detail["seconds"] = round(time.monotonic() - t0, 1)
            results.append(result)
            print(f"{result.name}: {result.status} {result.figure}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.copyfile(base / "swarmd.log", args.out / "swarmd.log")
        subprocess.run(["rm", "-rf", str(base)], check=False)
    text = table(results, machine_name(), sandbox)
    (args.out / "gpu_check.txt").write_text(text + "\n")
    (args.out / "gpu_check.json").write_text(json.dumps({
        "machine": machine_name(), "gpu": has_gpu(), "seconds": round(time.monotonic() - began, 1),
        "sandbox": sandbox, "results": [asdict(r) for r in results]}, indent=1, default=str))
    print(text)
    return 1 if any(r.status == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

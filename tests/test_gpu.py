"""The GPU check (bench/gpu, `make gpu-check`): on a machine with an NVIDIA GPU the tests
marked `gpu` run each check through a real daemon and ask it to pass; elsewhere they skip,
saying so, and the harness itself is tested: the daemon starts, the jobs run and report
that they saw no CUDA, the memory limit holds, and the report is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import __main__ as gpu
from bench.gpu import prepare

ROOT = Path(__file__).resolve().parents[1]
needs_gpu = pytest.mark.skipif(not gpu.has_gpu(), reason="no NVIDIA GPU here (nvidia-smi lists none)")


def test_what_travels_to_the_gpu_machine_is_what_swarmd_needs_beyond_its_image():
    wanted = {spec.split("==")[0].lower() for spec in prepare.closure()}
    assert {"libp2p", "trio", "pynacl", "structlog", "pyroute2", "multiaddr"} <= wanted
    assert not wanted & {"torch", "aiohttp", "msgpack", "numpy", "transformers"}, "the image has those"
    assert all("==" in spec for spec in prepare.closure()), "the venv's exact versions"


@pytest.mark.slow
@pytest.mark.skipif(gpu.has_gpu(), reason="the GPU tests below run the checks for real")
def test_without_a_gpu_the_check_runs_its_jobs_skips_what_needs_one_and_writes_its_report(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--out", str(tmp_path), "--budget", "300",
                           "--only", "nvml,cuda_job,oom,serve,finetune"], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    by = {r["name"]: r for r in report["results"]}
    assert list(by) == ["nvml", "cuda_job", "oom", "serve", "finetune"] and report["gpu"] is False
    assert by["nvml"]["status"] == "skip" and "no NVIDIA GPU" in by["nvml"]["figure"]
    for name in ("cuda_job", "finetune"):  # the job ran through the daemon and saw no CUDA
        assert by[name]["status"] == "skip" and "cuda=False" in by[name]["figure"], by[name]
        assert by[name]["detail"]["job"]["state"] == "succeeded", by[name]
    assert by["oom"]["status"] in ("pass", "skip"), by["oom"]
    if by["oom"]["status"] == "pass":  # the sandbox's memory cgroup is here (root, cgroup v2)
        assert "out of memory" in by["oom"]["figure"]
    text = (tmp_path / "gpu_check.txt").read_text()
    assert text.startswith("GPU check on ") and "sandbox:" in text and "cuda_job   skip" in text
    assert (tmp_path / "swarmd.log").stat().st_size > 0


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpu")
    port = gpu.free_port()
    proc, swarm = gpu.start_daemon(base, port)
    yield gpu.Ctx(swarm=swarm, gpu=True, gateway=port, deadline=float("inf"),
                  sandbox=swarm.status().get("sandbox") or {})
    proc.terminate()
    proc.wait(30)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("check", gpu.CHECKS, ids=[c.__name__.removeprefix("check_") for c in gpu.CHECKS])
def test_the_gpu_path_passes_each_check(ctx, check):
    result = check(ctx)
    if result.status == "skip":
        pytest.skip(result.figure)
    assert result.status == "pass", (result.figure, result.detail)

"""`make gpu-check` on a machine without a GPU: what the lent GPU machine needs to run the check,
in ``.gpu/`` (git-ignored through .git/info/exclude), to carry there.

The lent machine (the device tool's KINDS.md) has Python 3.12 with torch, transformers,
peft, aiohttp, msgpack, psutil, rich, uvloop, pyyaml, nvidia-ml-py and more, and reaches no
package index. What swarmd needs beyond that (libp2p and its dependencies, trio, pynacl,
structlog, pyroute2) travels as wheels for CPython 3.12 on x86-64 Linux, the versions this
checkout's venv runs: downloaded where PyPI has a wheel, built here with a Python 3.12 where
it has only a source (fastecdsa, a C extension against GMP: libgmp travels beside it, in
``.gpu/lib``). What travels must stay under the device call's 64 MiB with the checkout:
``MAX_MB`` for the wheels. Ray (a 70 MB wheel) and bitsandbytes do not fit; the check says
so (skip) unless the machine has them.

Then, with the device tool: ``run`` with ``carry: [".gpu"]`` and the command
``bash bench/gpu/run.sh`` (or ``make gpu-check``); the table and JSON come back under $OUT.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / ".gpu"
MAX_MB = 48
NEEDED = ("libp2p", "trio", "pynacl", "structlog", "pyroute2")
# What the lent machine's image holds already (KINDS.md, "Python packages already there", as read
# on 2026-11-17): not carried.
ON_DEVICE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal anyio attrs certifi charset-normalizer click
cloudpickle filelock frozenlist fsspec grpcio h11 httpcore httpx huggingface-hub hypothesis idna jinja2 joblib
markdown-it-py markupsafe mdurl msgpack multidict numpy nvidia-ml-py packaging pathspec peft pip pluggy
prometheus-client propcache protobuf psutil pygments pyparsing pytest python-dateutil pyyaml regex requests rich
safetensors scikit-learn scipy sentencepiece setuptools six sympy threadpoolctl tokenizers torch tqdm transformers
typing-extensions urllib3 uvloop werkzeug wheel wrapt yarl zipp
""".split())
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_34_x86_64", "manylinux1_x86_64", "any")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure() -> list[str]:
    """name==version of everything NEEDED pulls in that the device lacks, from this venv."""
    out, seen, todo = [], set(), list(NEEDED)
    while todo:
        name = norm(todo.pop())
        if name in seen or name in ON_DEVICE:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # a marker this Python does not take (exceptiongroup on 3.11+)
        out.append(f"{dist.metadata['Name']}=={dist.version}")
        for req in dist.requires or []:
            if "extra ==" in req or 'sys_platform == "win32"' in req or "Windows" in req:
                continue
            todo.append(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
    return sorted(out)


def python312() -> str | None:
    for candidate in ("python3.12", str(Path.home() / ".pyenv/versions/3.12.1/bin/python")):
        found = shutil.which(candidate) or (candidate if Path(candidate).exists() else None)
        if found and subprocess.run([found, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                                    capture_output=True).returncode == 0:
            return found
    return None


def main() -> int:
    wheels, lib = GPU / "wheels", GPU / "lib"
    shutil.rmtree(GPU, ignore_errors=True)
    wheels.mkdir(parents=True)
    exclude = ROOT / ".git" / "info" / "exclude"
    if exclude.parent.is_dir() and "/.gpu/" not in (exclude.read_text() if exclude.exists() else ""):
        with exclude.open("a") as f:
            f.write("/.gpu/\n")
    built: list[str] = []
    for spec in closure():
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                              "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
                              *[f"--platform={p}" for p in PLATFORMS], "-d", str(wheels), spec],
                             capture_output=True, text=True)
        if got.returncode == 0:
            continue
        py = python312()
        if py is None:
            print(f"gpu-check: {spec} has no wheel for CPython 3.12 and there is no Python 3.12 here to build one",
                  file=sys.stderr)
            return 1
        made = subprocess.run([py, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), spec],
                              capture_output=True, text=True)
        if made.returncode != 0:
            print(f"gpu-check: building {spec} for 3.12 failed:\n{made.stderr[-2000:]}", file=sys.stderr)
            return 1
        built.append(spec)
    if any(s.lower().startswith("fastecdsa") for s in built):
        lib.mkdir()
        for so in Path("/usr/lib/x86_64-linux-gnu").glob("libgmp.so.10*"):
            shutil.copy2(so, lib / so.name)
    size = sum(f.stat().st_size for f in GPU.rglob("*") if f.is_file()) / 2**20
    print(f"gpu-check: {len(list(wheels.glob('*.whl')))} wheels in {wheels.relative_to(ROOT)} ({size:.1f} MiB; "
          f"built here for 3.12: {', '.join(built) or 'none'})")
    if size > MAX_MB:
        print(f"gpu-check: {size:.1f} MiB is over the {MAX_MB} MiB that may travel beside the checkout",
              file=sys.stderr)
        return 1
    print("gpu-check: now, with the device tool: run(command='bash bench/gpu/run.sh', carry=['.gpu'])")
    return 0


if __name__ == "__main__":
    sys.exit(main())

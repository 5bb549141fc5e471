"""The floors of DESIGN's layout as a contract (pyproject's [tool.importlinter]): each package
imports only the floors below it, siblings of one floor not each other, no circles; and
every module of swarmd stands on a floor, so a new one cannot slip past the contract."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def test_the_import_contracts_hold():
    r = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert f"{len(contracts())} kept, 0 broken" in r.stdout, r.stdout[-3000:]


def test_every_module_of_swarmd_stands_on_a_floor():
    on_floors = {name.strip() for layer in contracts()["floors"]["layers"]
                 for name in layer.replace(":", "|").split("|")}
    top = {f"swarmd.{p.stem}" for p in (ROOT / "swarmd").glob("*.py") if p.stem != "__init__"}
    top |= {f"swarmd.{p.parent.name}" for p in (ROOT / "swarmd").glob("*/__init__.py")}
    assert top - on_floors == set(), "place these on a floor in pyproject's [tool.importlinter]"
    assert on_floors - top == set(), "these floors name no module"


def test_a_lower_floor_importing_a_higher_one_breaks_the_contract(tmp_path):
    """The contract can fail: a copy of the tree where the record schema imports the job side."""
    import shutil
    shutil.copytree(ROOT / "swarmd", tmp_path / "swarmd")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    wire = tmp_path / "swarmd" / "gossip" / "wire.py"
    wire.write_text(wire.read_text() + "\nfrom ..compute import spec  # noqa: E402\n")
    r = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    assert "swarmd.gossip.wire -> swarmd.compute.spec" in r.stdout, r.stdout[-3000:]

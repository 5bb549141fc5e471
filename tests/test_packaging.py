"""The built wheel carries everything `swarm-sim`, `swarmd` and `swarmctl` need (a non-editable
`pip install .` once dropped sim/data, and `swarm-sim lab up --countries` failed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Run from the installed wheel alone: every module of ours that swarm-sim, swarmd and swarmctl
# load must come from there, and the country data must load.
PROBE = """
import importlib, json, pkgutil, sys
sys.path.insert(0, sys.argv[1])
import sim, swarmd, swarmctl
for pkg in (sim, swarmd, swarmctl):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
import sim.cli, swarmd.main, swarmctl.main
from sim.netlab import topology
table = topology.country_table()
topology.check_countries(["DE", "US", "JP"], table)
ours = {n: getattr(m, "__file__", None) for n, m in sys.modules.items() if n.split(".")[0] in ("sim", "swarmd", "swarmctl")}
print(json.dumps({"ours": ours, "countries": len(table) if hasattr(table, "__len__") else None}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("swarmd", "swarmctl", "sim"):  # a copy: building writes build/ and *.egg-info beside the sources
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (path,) = out.glob("swarmd-*.whl")
    return path


@pytest.mark.slow
def test_the_wheel_carries_the_country_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in sorted((ROOT / "sim" / "data").iterdir()):
        assert f"sim/data/{data.name}" in names, f"{data.name} is not in {wheel.name}"


@pytest.mark.slow
def test_the_wheel_carries_the_shipped_scenarios(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for scenario in sorted((ROOT / "sim" / "scenarios").glob("*.toml")):
        assert f"sim/scenarios/{scenario.name}" in names, f"{scenario.name} is not in {wheel.name}"


@pytest.mark.slow
def test_the_wheel_carries_the_consoles_page(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for asset in sorted((ROOT / "swarmd" / "console" / "static").iterdir()):
        assert f"swarmd/console/static/{asset.name}" in names, f"{asset.name} is not in {wheel.name}"


@pytest.mark.slow
def test_everything_swarm_sim_imports_runs_from_the_wheel_alone(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                        str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", PROBE, str(target)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ours = json.loads(r.stdout)["ours"]
    assert "sim.netlab.lab" in ours and "swarmd.node" in ours
    elsewhere = {n: f for n, f in ours.items() if f is not None and not f.startswith(str(target))}
    assert not elsewhere, f"loaded from outside the wheel: {elsewhere}"

"""DESIGN principle 1: protocol cores never touch I/O, clocks or trio, not even through a module
they import (the check follows the project's own imports transitively: `membership` once reached
psutil through `wire` and `capacity`)."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORES = ["swarmd/rpc/framing.py", "swarmd/rpc/protocol.py", "swarmd/p2p/signed.py", "swarmd/gossip/cert.py",
         "swarmd/gossip/wire.py", "swarmd/gossip/suspicion.py", "swarmd/gossip/membership.py",
         "swarmd/gossip/revocation.py", "swarmd/gossip/owner.py",
         "swarmd/wg/address.py", "swarmd/wg/endpoint.py", "swarmd/wg/reconciler.py", "swarmd/compute/spec.py",
         "swarmd/compute/coordinator/placement.py", "swarmd/compute/ledger.py", "swarmd/compute/coordinator/gang.py",
         "swarmd/compute/coordinator/run.py", "swarmd/compute/coordinator/growth.py", "swarmd/compute/succession.py",
         "swarmd/compute/ids.py", "swarmd/compute/checkpoints/rules.py", "swarmd/compute/events.py",
         "swarmd/routing/paths.py", "swarmd/routing/request.py", "swarmd/routing/direct.py", "swarmd/wg/reach.py",
         "swarmd/routing/relay.py", "swarmd/routing/nft.py",
         "swarmd/vivaldi/coordinates.py", "swarmd/gossip/registry.py", "swarmd/serve/registry.py", "swarmd/serve/control.py", "swarmd/serve/balance.py",
         "swarmd/serve/scaler.py", "swarmd/serve/demand.py"]
FORBIDDEN = {"trio", "socket", "time", "os", "asyncio", "select", "selectors", "libp2p", "psutil", "pynvml",
             "subprocess", "threading"}


def _module_path(module: str) -> Path | None:
    """The file of a module of this project (``swarmd.gossip.wire``), or None for another package."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(path: Path) -> tuple[set[str], set[Path]]:
    """(top-level names of the outside packages ``path`` imports at module level, files of this
    project it imports). Imports inside functions run only when called; those are the I/O edges'
    business (``capacity.Collector`` imports psutil when it samples)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    outside, ours = set(), set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.body = []  # not module level
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            found = _module_path(name) if name.startswith("swarmd") else None
            if found is not None:
                ours.add(found)
            elif not name.startswith("swarmd"):
                outside.add(name.split(".")[0])
    return outside, ours


def _walk(path: Path) -> tuple[set[tuple[str, Path]], set[Path]]:
    """(every (outside package, file of ours importing it) ``path`` reaches, every file of this
    project it reaches, itself included), following this project's imports transitively."""
    seen: set[Path] = set()
    todo, out = [path], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        outside, ours = _imports(p)
        out |= {(name, p) for name in outside}
        todo += ours - seen
    return out, seen


def reached(path: Path) -> dict[str, Path]:
    """Every outside package ``path`` reaches through this project's modules -> a file importing it."""
    return {name: where for name, where in sorted(_walk(path)[0], reverse=True)}


@pytest.mark.parametrize("path", CORES)
def test_core_imports_no_io(path):
    bad = sorted((name, str(where.relative_to(ROOT))) for name, where in _walk(ROOT / path)[0] if name in FORBIDDEN)
    assert not bad, f"{path} reaches {bad}"


def test_the_check_follows_imports():
    assert "trio" in reached(ROOT / "swarmd/gossip/service.py")
    assert {"msgpack", "nacl"} <= reached(ROOT / "swarmd/gossip/wire.py").keys()  # through signed and cert


@pytest.mark.parametrize("core", ["swarmd/gossip/membership.py", "swarmd/gossip/suspicion.py"])
def test_the_membership_core_reaches_only_the_standard_library(core):
    """The simulator runs thousands of these cores: no wire format, no crypto, no system probes
    (membership once reached msgpack, nacl and psutil through ``wire``)."""
    outside, files = _walk(ROOT / core)
    assert not {name for name, _ in outside} & {"msgpack", "nacl", "psutil"}
    assert [(name, str(where.relative_to(ROOT))) for name, where in sorted(outside)
            if name not in sys.stdlib_module_names and name != "__future__"] == []
    assert not {name for name, _ in outside} & FORBIDDEN
    assert {str(f.relative_to(ROOT)) for f in files} <= {"swarmd/gossip/membership.py", "swarmd/gossip/suspicion.py",
                                                       "swarmd/gossip/__init__.py", "swarmd/__init__.py"}

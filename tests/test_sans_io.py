"""DESIGN principle 1: protocol cores never touch I/O, clocks or trio, not even through a module
they import (the check follows the project's own imports transitively: `membership` once reached
psutil through `wire` and `capacity`)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORES = ["swarmd/rpc/framing.py", "swarmd/rpc/protocol.py", "swarmd/gossip/signed.py", "swarmd/gossip/cert.py",
         "swarmd/gossip/wire.py", "swarmd/gossip/suspicion.py", "swarmd/gossip/membership.py",
         "swarmd/gossip/revocation.py", "swarmd/gossip/owner.py",
         "swarmd/wg/address.py", "swarmd/wg/reconciler.py", "swarmd/compute/spec.py",
         "swarmd/compute/placement.py", "swarmd/compute/ledger.py", "swarmd/compute/gang.py", "swarmd/compute/run.py",
         "swarmd/compute/ids.py", "swarmd/compute/checkpoints.py", "swarmd/compute/events.py"]
FORBIDDEN = {"trio", "socket", "time", "asyncio", "select", "selectors", "libp2p", "psutil", "pynvml",
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


def reached(path: Path) -> dict[str, Path]:
    """Every outside package ``path`` reaches through this project's modules -> the file importing it."""
    seen, todo, out = set(), [path], {}
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        outside, ours = _imports(p)
        for name in outside:
            out.setdefault(name, p)
        todo += ours - seen
    return out


@pytest.mark.parametrize("path", CORES)
def test_core_imports_no_io(path):
    bad = {name: str(where.relative_to(ROOT)) for name, where in reached(ROOT / path).items() if name in FORBIDDEN}
    assert not bad, f"{path} reaches {bad}"


def test_the_check_follows_imports():
    assert "psutil" in reached(ROOT / "swarmd/gossip/service.py") or "trio" in reached(ROOT / "swarmd/gossip/service.py")
    assert reached(ROOT / "swarmd/gossip/membership.py").keys() >= {"msgpack", "nacl"}  # through wire and signed

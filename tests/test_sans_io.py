"""DESIGN principle 1: protocol cores never touch I/O, clocks or trio."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORES = ["swarmd/rpc/framing.py", "swarmd/rpc/protocol.py", "swarmd/gossip/signed.py", "swarmd/gossip/cert.py",
         "swarmd/gossip/wire.py", "swarmd/gossip/suspicion.py", "swarmd/gossip/membership.py",
         "swarmd/wg/address.py", "swarmd/wg/reconciler.py", "swarmd/compute/spec.py",
         "swarmd/compute/placement.py", "swarmd/compute/ledger.py", "swarmd/compute/gang.py", "swarmd/compute/run.py"]
FORBIDDEN = {"trio", "socket", "time", "asyncio", "select", "selectors", "libp2p"}


@pytest.mark.parametrize("path", CORES)
def test_core_imports_no_io(path):
    tree = ast.parse((ROOT / path).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN, f"{path} imports {imported & FORBIDDEN}"

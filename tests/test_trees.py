"""trees.py, the one door for trees a peer or a job shaped: any depth, links never followed;
and a scan that keeps compute code from walking such a tree any other way (issue 23)."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

import deep_trees
import swarmd.compute
from swarmd.compute import trees

COMPUTE = Path(swarmd.compute.__file__).parent


@pytest.fixture
def deep_safe(tmp_path):
    yield tmp_path
    deep_trees.remove(tmp_path)  # pytest's own removal is shutil.rmtree


def test_a_tree_deeper_than_pythons_recursion_limit_is_copied_handed_over_and_removed(deep_safe):
    src = deep_trees.make_deep(deep_safe / "src")
    trees.copy(src, deep_safe / "dest")
    assert deep_trees.depth(deep_safe / "dest") == deep_trees.DEEP
    if os.geteuid() == 0:
        trees.give(deep_safe / "dest", 65534, 65534)
        assert (deep_safe / "dest").stat().st_uid == (deep_safe / "dest" / "d").stat().st_uid == 65534
    trees.remove(deep_safe / "dest")
    trees.remove(src)
    assert list(deep_safe.iterdir()) == []


def test_links_are_copied_and_handed_over_as_links_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("the daemon's")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "run.sh").write_text("echo\n")
    (src / "sub" / "run.sh").chmod(0o750)
    (src / "out").symlink_to(outside)
    trees.copy(src, tmp_path / "dest")
    assert (tmp_path / "dest" / "out").is_symlink() and os.readlink(tmp_path / "dest" / "out") == str(outside)
    assert stat.S_IMODE((tmp_path / "dest" / "sub" / "run.sh").stat().st_mode) == 0o750, "modes kept"
    if os.geteuid() == 0:
        trees.give(tmp_path / "dest", 65534, 65534)
        assert outside.stat().st_uid == 0 and (tmp_path / "dest" / "out").lstat().st_uid == 65534
    with pytest.raises(trees.TreeError, match=f"cp: {tmp_path / 'dest'} exists"):
        trees.copy(src, tmp_path / "dest")  # never copied into it


# --- the scan -------------------------------------------------------------------------------

# Standard-library calls that walk a whole tree by recursion (os.walk and shutil.rmtree on
# Python 3.11; the rest by design), or leave links and depth to the caller.
RECURSIVE = {"rmtree", "copytree", "walk", "fwalk", "rglob", "move"}

# Trees the daemon alone made and fills, where such a call is fine; each with its reason.
ALLOWED = {
    # the coordinator's per-job directory in STATE_DIR: the daemon writes its output.log, nothing else
    ("coordinator/store.py", "rmtree"),
    # raynode.py is the job's own launcher: it runs in the job's sandbox as the job's uid, on the
    # Ray temp dir it made itself; what it leaves the daemon removes (worker, trees.remove)
    ("host/raynode.py", "rmtree"),
}


def recursive_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of each recursive tree call in `source`: `x.rmtree(...)` and the like,
    names imported from shutil or os, and glob patterns with `**`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in ("shutil", "os", "os.path"):
            found += [(node.lineno, a.name) for a in node.names if a.name in RECURSIVE]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in RECURSIVE:
                found.append((node.lineno, node.func.attr))
            elif node.func.attr in ("glob", "iglob") and any(
                    isinstance(a, ast.Constant) and isinstance(a.value, str) and "**" in a.value for a in node.args):
                found.append((node.lineno, "glob **"))
    return found


@pytest.mark.parametrize("snippet, name", [
    ("import shutil\nshutil.rmtree(p, ignore_errors=True)", "rmtree"),
    ("shutil.copytree(tree, work, symlinks=False)", "copytree"),
    ("for d, _, _ in os.walk(into):\n    pass", "walk"),
    ("from shutil import rmtree", "rmtree"),
    ("list(root.rglob('*'))", "rglob"),
    ("root.glob('**/*.pt')", "glob **"),
    ("Path(p).walk()", "walk"),
])
def test_the_scan_finds_each_kind_of_recursive_call(snippet, name):
    assert [n for _, n in recursive_calls(snippet)] == [name]


def test_the_scan_passes_what_is_not_recursive():
    assert recursive_calls("root.glob('.unpack-*')\nshutil.which('rm')\nshutil.copyfileobj(a, b)\n"
                           "trees.remove(p)\nos.scandir(p)") == []


def test_compute_code_walks_copies_and_removes_trees_only_through_trees_py():
    """A peer or a job shapes the trees compute code handles: a recursive walk of one raised
    RecursionError (issue 23, findings 1 and 5). Use trees.py; a tree the daemon alone made
    goes in ALLOWED with its reason."""
    offending = []
    used = set()
    for path in sorted(COMPUTE.rglob("*.py")):  # noqa: the daemon's own source tree
        rel = path.relative_to(COMPUTE).as_posix()
        for line, name in recursive_calls(path.read_text()):
            if (rel, name) in ALLOWED:
                used.add((rel, name))
            else:
                offending.append(f"swarmd/compute/{rel}:{line}: {name}")
    assert offending == [], "use swarmd/compute/trees.py (fts, any depth) instead"
    assert used == ALLOWED, "an allowance no longer needed: take it out"

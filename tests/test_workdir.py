"""Workdirs: deterministic packing that honours .gitignore, and a cache that trusts nothing."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile

import pytest

from swarmd.compute.workdir import Cache, WorkdirError, pack


def tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def names(packed):
    with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r:gz") as tar:
        return sorted(m.name for m in tar.getmembers() if m.isfile())


def test_the_same_tree_packs_to_the_same_digest_whatever_the_times(tmp_path):
    a = tree(tmp_path / "a", {"train.py": "print(1)\n", "lib/util.py": "x = 1\n"})
    first = pack(a)
    os.utime(a / "train.py", (1, 1))
    assert pack(a).digest == first.digest and first.files == 2


def test_gitignore_rules_root_nested_and_negated(tmp_path):
    root = tree(tmp_path / "w", {
        ".gitignore": "*.ckpt\ndata/\n!keep.ckpt\n", "train.py": "", "model.ckpt": "", "keep.ckpt": "",
        "data/big.bin": "", "sub/.gitignore": "local.txt\n", "sub/local.txt": "", "sub/code.py": "",
        ".git/HEAD": "ref"})
    (root / "link.py").symlink_to(root / "train.py")
    assert names(pack(root)) == [".gitignore", "keep.ckpt", "sub/.gitignore", "sub/code.py", "train.py"]


def test_too_large_a_workdir_is_refused_saying_what_to_do(tmp_path):
    root = tmp_path / "w"
    root.mkdir()
    (root / "blob").write_bytes(os.urandom(2 * 1024 * 1024))
    with pytest.raises(WorkdirError, match=r"larger than 1 MiB packed; add what the job does not need to .gitignore"):
        pack(root, limit=1024 * 1024)
    with pytest.raises(WorkdirError, match="no such directory"):
        pack(tmp_path / "missing")


def test_the_cache_unpacks_once_read_only_for_others(tmp_path):
    packed = pack(tree(tmp_path / "w", {"run.sh": "echo hi\n", "d/x.txt": "x"}))
    (tmp_path / "w" / "run.sh").chmod(0o755)
    packed = pack(tmp_path / "w")
    cache = Cache(tmp_path / "cache")
    path = cache.put(packed.digest, packed.data)
    assert cache.has(packed.digest) and (path / "d" / "x.txt").read_text() == "x"
    assert stat.S_IMODE((path / "run.sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((path / "d" / "x.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE((path / "d").stat().st_mode) == 0o755
    assert cache.put(packed.digest, packed.data) == path, "a second put is harmless"


def evil(members):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


@pytest.mark.parametrize("name, kind", [("../escape.txt", tarfile.REGTYPE), ("/etc/passwd", tarfile.REGTYPE),
                                        ("link", tarfile.SYMTYPE), ("dev", tarfile.CHRTYPE)])
def test_the_cache_refuses_archives_that_reach_outside(tmp_path, name, kind):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else ""
    data = evil([(info, b"" if kind == tarfile.REGTYPE else None)])
    with pytest.raises(WorkdirError, match="only plain files and directories"):
        Cache(tmp_path / "cache").put(hashlib.sha256(data).hexdigest(), data)
    assert not (tmp_path / "escape.txt").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [], "nothing half-unpacked is left"


def test_the_cache_refuses_a_digest_mismatch(tmp_path):
    packed = pack(tree(tmp_path / "w", {"a": "1"}))
    with pytest.raises(WorkdirError, match="does not match its digest"):
        Cache(tmp_path / "cache").put("0" * 64, packed.data)


def test_least_recently_used_trees_are_evicted(tmp_path):
    cache = Cache(tmp_path / "cache", keep=2)
    digests = []
    for i in range(3):
        packed = pack(tree(tmp_path / f"w{i}", {"f": str(i)}))
        cache.put(packed.digest, packed.data)
        os.utime(cache.path(packed.digest), (i + 1, i + 1))
        digests.append(packed.digest)
    packed = pack(tree(tmp_path / "w3", {"f": "3"}))
    cache.put(packed.digest, packed.data)
    assert [cache.has(d) for d in digests] == [False, False, True] and cache.has(packed.digest)

"""Workdirs: deterministic packing that honours .gitignore, and a cache that trusts nothing."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import subprocess
import sys
import tarfile
import threading

import pytest
import structlog

import deep_trees
from swarmd.compute import trees
from swarmd.compute.workdir import ENTRY_FLOOR, MAX_DEPTH, MAX_ENTRIES, MAX_HEADER, Cache, WorkdirError, pack


def tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def names(packed):
    with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r:gz") as tar:
        return sorted(m.name for m in tar.getmembers() if m.isfile())


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def put_tree(cache, root, files):
    packed = pack(tree(root, files))
    return packed.digest, cache.put(packed.digest, packed.data)


def test_the_same_tree_packs_to_the_same_digest_whatever_the_times_and_place(tmp_path):
    files = {"train.py": "print(1)\n", "lib/util.py": "x = 1\n"}
    first = pack(tree(tmp_path / "a", files))
    os.utime(tmp_path / "a" / "train.py", (1, 1))
    os.utime(tmp_path / "a" / "lib", (2, 2))
    assert pack(tmp_path / "a").digest == first.digest
    assert pack(tree(tmp_path / "elsewhere", dict(reversed(files.items())))).digest == first.digest
    assert (first.files, first.size) == (2, len("print(1)\n") + len("x = 1\n"))
    (tmp_path / "a" / "train.py").chmod(0o755)
    assert pack(tmp_path / "a").digest != first.digest, "the executable bit is part of the tree"


def test_gitignore_rules_root_nested_and_negated(tmp_path):
    root = tree(tmp_path / "w", {
        ".gitignore": "*.ckpt\ndata/\n!keep.ckpt\n", "train.py": "", "model.ckpt": "", "keep.ckpt": "",
        "data/big.bin": "", "sub/.gitignore": "local.txt\n", "sub/local.txt": "", "sub/code.py": "",
        ".git/HEAD": "ref"})
    (root / "link.py").symlink_to(root / "train.py")
    (root / "linkdir").symlink_to(root / "sub")
    assert names(pack(root)) == [".gitignore", "keep.ckpt", "sub/.gitignore", "sub/code.py", "train.py"]


def test_a_nested_gitignore_rules_its_own_subtree_only_and_overrides_the_root(tmp_path):
    root = tree(tmp_path / "w", {
        ".gitignore": "*.log\n", "a/.gitignore": "out.txt\n!keep.log\n/top.txt\n", "a/out.txt": "", "a/keep.log": "",
        "a/top.txt": "", "a/deeper/top.txt": "", "a/deeper/x.log": "", "b/out.txt": "", "b/keep.log": ""})
    assert names(pack(root)) == [".gitignore", "a/.gitignore", "a/deeper/top.txt", "a/keep.log", "b/out.txt"]


def test_too_large_a_workdir_is_refused_saying_what_to_do(tmp_path):
    root = tmp_path / "w"
    root.mkdir()
    (root / "blob").write_bytes(os.urandom(2 * 1024 * 1024))
    with pytest.raises(WorkdirError, match=rf"workdir {root} is larger than 1 MiB packed; "
                                           r"add what the job does not need to .gitignore"):
        pack(root, limit=1024 * 1024)
    (root / ".gitignore").write_text("blob\n")
    assert pack(root, limit=1024 * 1024).files == 1


def test_a_missing_or_plain_file_root_is_named(tmp_path):
    with pytest.raises(WorkdirError, match=f"workdir {tmp_path / 'missing'}: no such directory"):
        pack(tmp_path / "missing")
    (tmp_path / "f").write_text("")
    with pytest.raises(WorkdirError, match=f"workdir {tmp_path / 'f'}: not a directory"):
        pack(tmp_path / "f")


def test_the_cache_unpacks_once_read_only_for_others(tmp_path):
    tree(tmp_path / "w", {"run.sh": "echo hi\n", "d/x.txt": "x"})
    (tmp_path / "w" / "run.sh").chmod(0o700)
    (tmp_path / "w" / "d" / "x.txt").chmod(0o600)
    packed = pack(tmp_path / "w")
    cache = Cache(tmp_path / "cache")
    assert not cache.has(packed.digest)
    path = cache.put(packed.digest, packed.data)
    assert cache.has(packed.digest) and cache.path(packed.digest) == path
    assert (path / "d" / "x.txt").read_text() == "x" and (path / "run.sh").read_text() == "echo hi\n"
    assert [mode(path / "run.sh"), mode(path / "d" / "x.txt"), mode(path / "d"), mode(path)] == [0o755, 0o644,
                                                                                               0o755, 0o755]
    assert mode(tmp_path / "cache") == 0o700, "the cache itself is the daemon's"
    assert cache.put(packed.digest, packed.data) == path, "a second put is harmless"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [packed.digest]


def archive(members):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            info.size = len(data or b"")
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def member(name, kind=tarfile.REGTYPE, **attrs):
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in attrs.items():
        setattr(info, k, v)
    return info


def put(cache, data):
    return cache.put(hashlib.sha256(data).hexdigest(), data)


@pytest.mark.parametrize("info", [
    member("../escape.txt"), member("/etc/passwd"), member("a/../../escape.txt"),
    member("link", tarfile.SYMTYPE, linkname="/etc/passwd"), member("hard", tarfile.LNKTYPE, linkname="x"),
    member("dev", tarfile.CHRTYPE), member("fifo", tarfile.FIFOTYPE)], ids=lambda m: m.name)
def test_the_cache_refuses_archives_that_reach_outside(tmp_path, info):
    cache = Cache(tmp_path / "cache")
    data = archive([(member("fine.txt"), b"ok"), (info, b"" if info.isfile() else None)])
    with pytest.raises(WorkdirError, match=f"the workdir holds '{info.name}': only plain files and directories"):
        put(cache, data)
    assert not (tmp_path / "escape.txt").exists()
    assert list((tmp_path / "cache").iterdir()) == [], "nothing half-unpacked is left"


def test_the_cache_refuses_a_digest_mismatch_and_a_broken_archive(tmp_path):
    cache = Cache(tmp_path / "cache")
    packed = pack(tree(tmp_path / "w", {"a": "1"}))
    with pytest.raises(WorkdirError, match="does not match its digest"):
        cache.put("0" * 64, packed.data)
    tampered = bytearray(packed.data)
    tampered[len(tampered) // 2] ^= 0xFF
    with pytest.raises(WorkdirError, match="does not match its digest"):
        cache.put(packed.digest, bytes(tampered))
    for junk in (bytes(tampered), packed.data[:len(packed.data) // 2], b"not an archive"):
        with pytest.raises(WorkdirError, match="the workdir archive is unreadable"):
            put(cache, junk)
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_cache_refuses_a_gzip_bomb(tmp_path):
    cache = Cache(tmp_path / "cache", unpacked_limit=1024 * 1024)
    data = archive([(member("zeros"), bytes(2 * 1024 * 1024))])
    assert len(data) < 10_000
    with pytest.raises(WorkdirError, match="unpacks to more than 1 MiB"):
        put(cache, data)
    many = archive([(member(f"f{i}"), b"") for i in range(3000)])
    with pytest.raises(WorkdirError, match="unpacks to more than 1 MiB"):
        put(cache, many)
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_cache_takes_neither_modes_nor_owners_from_a_peer(tmp_path):
    cache = Cache(tmp_path / "cache")
    data = archive([(member("d", tarfile.DIRTYPE, mode=0o777), None),
                    (member("d/setuid", mode=0o4777, uid=4242, gid=4242, uname="evil", gname="evil"), b"x"),
                    (member("d/writable", mode=0o666, uid=4242), b"y")])
    path = put(cache, data)
    assert [mode(path / "d"), mode(path / "d" / "setuid"), mode(path / "d" / "writable")] == [0o755, 0o755, 0o644]
    assert {(path / "d" / n).stat().st_uid for n in ("setuid", "writable")} == {os.geteuid()}


@pytest.mark.parametrize("digest", ["..", "/etc", ".", "", "A" * 64, "../" + "0" * 61, "0" * 63])
def test_only_a_sha256_digest_names_a_tree(tmp_path, digest):
    cache = Cache(tmp_path / "workdirs")
    assert not cache.has(digest), "a peer cannot point the cache at the state directory or /etc"
    with pytest.raises(WorkdirError, match="is not a workdir digest"):
        cache.path(digest)
    with pytest.raises(WorkdirError, match="is not a workdir digest"):
        with cache.hold(digest):
            pass
    with pytest.raises(WorkdirError, match="is not a workdir digest"):
        cache.put(digest, b"")


def test_concurrent_puts_of_one_digest_leave_one_whole_tree(tmp_path):
    packed = pack(tree(tmp_path / "w", {f"f{i}": str(i) * 1000 for i in range(50)}))
    cache = Cache(tmp_path / "cache")
    paths, errors, go = [], [], threading.Barrier(4)

    def one():
        go.wait()
        try:
            paths.append(cache.put(packed.digest, packed.data))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(paths)) == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [packed.digest]
    assert len(list(paths[0].iterdir())) == 50


def test_least_recently_used_trees_are_evicted_unless_held(tmp_path):
    cache = Cache(tmp_path / "cache", keep=2)
    digests = []
    for i in range(3):
        digest, path = put_tree(cache, tmp_path / f"w{i}", {"f": str(i)})
        os.utime(path, (i + 1, i + 1))
        digests.append(digest)
    newest, _ = put_tree(cache, tmp_path / "w3", {"f": "3"})
    assert [cache.has(d) for d in digests] == [False, False, True] and cache.has(newest)

    kept = digests[2]
    os.utime(cache.path(kept), (1, 1))
    os.utime(cache.path(newest), (2, 2))
    assert cache.has(kept), "asking counts as use"
    put_tree(cache, tmp_path / "w4", {"f": "4"})
    assert cache.has(kept) and not cache.has(newest)

    with cache.hold(kept) as path:
        os.utime(path, (1, 1))
        for i in (5, 6):
            put_tree(cache, tmp_path / f"w{i}", {"f": str(i)})
        assert (path / "f").read_text() == "2", "a held tree stays while a job copies it"
    put_tree(cache, tmp_path / "w7", {"f": "7"})
    assert not cache.has(kept), "and goes once let go"


def test_holding_a_tree_that_is_not_there_says_so(tmp_path):
    with pytest.raises(WorkdirError, match=f"workdir {'a' * 12} is not in the cache"):
        with Cache(tmp_path / "cache").hold("a" * 64):
            pass


def test_half_unpacked_leftovers_of_a_killed_daemon_are_cleared(tmp_path):
    cache = Cache(tmp_path / "cache")
    digest, _ = put_tree(cache, tmp_path / "w", {"f": "1"})
    (tmp_path / "cache" / ".unpack-abc" / "d").mkdir(parents=True)
    again = Cache(tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [digest] and again.has(digest)


def test_an_archive_that_is_gzip_but_not_tar_is_unreadable(tmp_path):
    with pytest.raises(WorkdirError, match="the workdir archive is unreadable"):
        put(Cache(tmp_path / "cache"), gzip.compress(b"x" * 1000, mtime=0))


# --- what a member or a local user shapes (issue 23): depth, entries, the floor, start-up ---

@pytest.fixture
def deep_safe(tmp_path):
    """tmp_path, removed with rm at the end: pytest's shutil.rmtree would fail on a deep tree."""
    yield tmp_path
    deep_trees.remove(tmp_path)


def test_a_workdir_1200_directories_deep_is_refused_before_anything_is_created(deep_safe):
    """Finding 1: 23 KB from one member made os.walk and rmtree raise RecursionError, left a
    half-unpacked tree, and the daemon died at every start."""
    cache = Cache(deep_safe / "cache")
    data = deep_trees.deep_archive()
    assert len(data) < 30_000
    with pytest.raises(WorkdirError, match=rf"65 names deep: at most {MAX_DEPTH} are accepted"):
        put(cache, data)
    assert list((deep_safe / "cache").iterdir()) == [], "nothing was created, nothing is left"
    Cache(deep_safe / "cache")  # and the next start comes up


@pytest.mark.parametrize("depth, accepted", [(MAX_DEPTH, True), (MAX_DEPTH + 1, False)])
def test_names_are_at_most_max_depth_deep(tmp_path, depth, accepted):
    cache = Cache(tmp_path / "cache")
    name = "/".join(["d"] * (depth - 1) + ["f"])
    data = archive([(member(name), b"x")])
    if accepted:
        path = put(cache, data)
        assert (path / name).read_bytes() == b"x"
        assert {mode(path / "/".join(["d"] * i)) for i in (1, depth - 1)} == {0o755}, \
            "directories a file implies are made readable like the listed ones"
    else:
        with pytest.raises(WorkdirError, match=f"{depth} names deep"):
            put(cache, data)
        assert list((tmp_path / "cache").iterdir()) == []


def test_entries_beyond_the_cap_are_refused_before_anything_is_created(tmp_path):
    """Finding 7: each entry is an inode and a block; a cap on their number, not bytes alone."""
    cache = Cache(tmp_path / "cache", max_entries=100)
    with pytest.raises(WorkdirError, match="the workdir holds more than 100 files and directories"):
        put(cache, archive([(member(f"f{i}"), b"") for i in range(101)]))
    assert list((tmp_path / "cache").iterdir()) == []
    assert len(list(put(cache, archive([(member(f"f{i}"), b"") for i in range(100)])).iterdir())) == 100


def test_every_entry_counts_as_at_least_one_block(tmp_path):
    """Finding 7: 512 bytes counted per header let two million empty files (12 MiB packed)
    under the 1 GiB cap; a block each makes that 8 GiB."""
    cache = Cache(tmp_path / "cache", unpacked_limit=1024 * 1024)
    assert len(list(put(cache, archive([(member(f"f{i}"), b"") for i in range(256)])).iterdir())) == 256
    with pytest.raises(WorkdirError, match=rf"unpacks to more than 1 MiB \(each file or directory counted "
                                           rf"as at least {ENTRY_FLOOR} bytes\)"):
        put(cache, archive([(member(f"g{i}"), b"") for i in range(257)]))
    with pytest.raises(WorkdirError, match="unpacks to more than 1 MiB"):
        put(cache, archive([(member("big"), bytes(1024 * 1024 - 1)), (member("one"), b"")]))


@pytest.mark.slow
def test_two_million_empty_files_are_refused_quickly_in_bounded_memory(tmp_path):
    """Finding 7, as a member sends it: the daemon held ~0.9 GB of headers and then made two
    million files. Run in a process of its own to read its peak memory."""
    archive_path = tmp_path / "flood.tar.gz"
    archive_path.write_bytes(deep_trees.empty_files_archive(2_000_000))
    digest = hashlib.sha256(archive_path.read_bytes()).hexdigest()
    # VmHWM, the peak of this process's own memory: ru_maxrss survives exec, so a child of a
    # large pytest process (torch and Ray imported by other tests) starts at its parent's peak
    script = ("import re, sys; from pathlib import Path; from swarmd.compute.workdir import Cache, WorkdirError\n"
              "try: Cache(Path(sys.argv[1])).put_file(sys.argv[2], Path(sys.argv[3]))\n"
              "except WorkdirError as exc: print(exc)\n"
              "print(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1])\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache"), digest, str(archive_path)],
                          capture_output=True, text=True, timeout=60, check=True)
    refusal, peak_kib = done.stdout.splitlines()
    assert refusal == f"the workdir holds more than {MAX_ENTRIES} files and directories"
    assert int(peak_kib) < 200 * 1024, "the headers read are not kept"
    assert list((tmp_path / "cache").iterdir()) == [], "nothing was created"


def test_a_name_given_twice_or_a_huge_extended_header_is_refused(tmp_path):
    cache = Cache(tmp_path / "cache")
    with pytest.raises(WorkdirError, match="the workdir names 'a' twice"):
        put(cache, archive([(member("a"), b"1"), (member("a"), b"2")]))
    with pytest.raises(WorkdirError, match="the workdir names 'd' twice"):
        put(cache, archive([(member("d"), b"1"), (member("d", tarfile.DIRTYPE), None)]))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(member("f", pax_headers={"comment": "x" * (MAX_HEADER + 1)}), io.BytesIO(b""))
    with pytest.raises(WorkdirError, match="an extended header of .* bytes"):
        put(cache, buf.getvalue())
    assert list((tmp_path / "cache").iterdir()) == [], "what was half-unpacked is gone"


def test_a_deep_leftover_of_an_older_daemon_is_removed_at_start(deep_safe):
    """Finding 1: the leftover the old code left made Cache() raise RecursionError at every start."""
    root = deep_safe / "cache"
    deep_trees.make_deep(root / ".unpack-abc")
    (root / ".unpack-upload-xyz").write_bytes(b"half an upload")
    cache = Cache(root)
    assert list(root.iterdir()) == []
    digest, _ = put_tree(cache, deep_safe / "w", {"f": "1"})
    assert cache.has(digest)


@pytest.mark.parametrize("error", [trees.TreeError("rm: cannot remove"), RecursionError("deep")],
                         ids=["tool", "anything"])
def test_a_leftover_that_cannot_be_removed_is_set_aside_and_the_cache_comes_up(tmp_path, monkeypatch, error):
    root = tmp_path / "cache"
    (root / ".unpack-abc" / "d").mkdir(parents=True)

    def fails(path):
        raise error

    monkeypatch.setattr(trees, "remove", fails)
    with structlog.testing.capture_logs() as logs:
        Cache(root)
    assert [p.name for p in root.iterdir()] == [".stuck-abc"]
    assert [(e["log_level"], e["path"]) for e in logs] == [("warning", str(root / ".unpack-abc"))]
    monkeypatch.undo()
    Cache(root)
    assert list(root.iterdir()) == [], "the next start tries again"


def test_pack_refuses_what_a_host_would_refuse_saying_what_to_do(tmp_path):
    root = tmp_path / "w"
    deep_trees.make_deep(root, MAX_DEPTH)
    assert pack(root).files == 0
    deep_trees.make_deep(root / "/".join(["d"] * MAX_DEPTH), 1)
    with pytest.raises(WorkdirError, match=f"is more than {MAX_DEPTH} names deep; add what the job does not "
                                           "need to .gitignore"):
        pack(root)

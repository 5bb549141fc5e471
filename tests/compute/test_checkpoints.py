"""Which files are checkpoints (names, the two-scan rule, what a file must be), which host
keeps a replica, which checkpoints are kept; then the host's cache (checkpoints/cache.py) on real
files: what it refuses to copy, what a job can and cannot do to what it installs."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import stat

import pytest

from swarmd.compute.checkpoints.rules import (MAX_LISTED, Copy, Scan, check_listed, choose_replica, is_checkpoint_name,
                                        keep_newest, make_room, refusal)
from swarmd.compute.checkpoints.cache import CACHE_DIR, Changed, CheckpointError, CkptCache, Watcher, clear_job_dir, listing

SHA = "a" * 64


@pytest.mark.parametrize("name, ok", [
    ("epoch-3.pt", True), ("ckpt_00012", True), ("model.safetensors", True), ("A" * 128, True), ("a.b-c_d", True),
    ("", False), ("A" * 129, False), (".hidden", False), ("..", False), (".", False), ("a/b", False),
    ("../etc", False), ("x\0y", False), ("ép.pt", False), ("a b", False), ("epoch.pt.tmp", False),
    ("epoch.pt.part", False), ("epoch.pt.partial", False), ("epoch.pt~", False), ("tmpabc123", False),
    ("tmp", False), (12, False), (None, False), (b"epoch.pt", False),
])
def test_checkpoint_names(name, ok):
    assert is_checkpoint_name(name) is ok


def test_two_consecutive_equal_scans_make_a_file_complete_and_it_is_told_once():
    scan = Scan()
    assert scan.observe({"e1.pt": (10, 1, 7)}) == [], "seen once: maybe still being written"
    assert scan.observe({"e1.pt": (10, 1, 7)}) == ["e1.pt"]
    assert scan.observe({"e1.pt": (10, 1, 7)}) == [], "told already"
    assert scan.observe({"e1.pt": (20, 2, 8)}) == [], "renamed over: a new file, not stable yet"
    assert scan.observe({"e1.pt": (20, 2, 8)}) == ["e1.pt"]


@pytest.mark.parametrize("scans, told", [
    # a writer appending: never two equal scans
    ([{"c": (1, 1, 5)}, {"c": (2, 2, 5)}, {"c": (3, 3, 5)}], [[], [], []]),
    # rewritten in place between scans (same size, new mtime) is not stable until it stops
    ([{"c": (4, 1, 5)}, {"c": (4, 2, 5)}, {"c": (4, 2, 5)}], [[], [], ["c"]]),
    # a temp name is never looked at; the rename to the final name is
    ([{"c.tmp": (4, 1, 5)}, {"c.tmp": (4, 1, 5)}, {"c": (4, 1, 5)}, {"c": (4, 1, 5)}], [[], [], [], ["c"]]),
    # a name that vanishes and comes back with a new file
    ([{"c": (4, 1, 5)}, {}, {"c": (4, 1, 5)}, {"c": (4, 1, 5)}], [[], [], [], ["c"]]),
    # several at once: oldest (mtime) first
    ([{"b": (1, 9, 1), "a": (1, 5, 2)}, {"b": (1, 9, 1), "a": (1, 5, 2)}], [[], ["a", "b"]]),
])
def test_the_scan_rule(scans, told):
    scan = Scan()
    assert [scan.observe(s) for s in scans] == told


def test_a_file_known_at_start_is_not_told_and_a_retry_tells_it_again():
    scan = Scan({"old": (1, 1, 1)})
    assert scan.observe({"old": (1, 1, 1), "new": (2, 2, 2)}) == []
    assert scan.observe({"old": (1, 1, 1), "new": (2, 2, 2)}) == ["new"]
    scan.retry("new")
    assert scan.observe({"old": (1, 1, 1), "new": (2, 2, 2)}) == ["new"]


R, L = stat.S_IFREG | 0o644, stat.S_IFLNK | 0o777


@pytest.mark.parametrize("fields, why", [
    (dict(mode=R, nlink=1, uid=1000, size=10), None),
    (dict(mode=L, nlink=1, uid=1000, size=10), "not a regular file"),
    (dict(mode=stat.S_IFIFO | 0o644, nlink=1, uid=1000, size=0), "not a regular file"),
    (dict(mode=stat.S_IFCHR | 0o644, nlink=1, uid=1000, size=0), "not a regular file"),
    (dict(mode=stat.S_IFDIR | 0o755, nlink=2, uid=1000, size=0), "not a regular file"),
    (dict(mode=R, nlink=2, uid=1000, size=10), "hard link"),
    (dict(mode=R, nlink=1, uid=0, size=10), "not the job's 1000"),
    (dict(mode=R, nlink=1, uid=1000, size=101), "over this host's checkpoint_max"),
    # sparse: a file with holes (truncate -s) costs the job nothing and a copy its whole length
    (dict(mode=R, nlink=1, uid=1000, size=8 << 20, blocks=0), "sparse: 8388608 bytes long but 0 on disk"),
    (dict(mode=R, nlink=1, uid=1000, size=8 << 20, blocks=(4 << 20) // 512 - 1), "sparse"),
    (dict(mode=R, nlink=1, uid=1000, size=8 << 20, blocks=(4 << 20) // 512), None),
    (dict(mode=R, nlink=1, uid=1000, size=1 << 20, blocks=0), None),  # small: block accounting is coarse
])
def test_what_a_checkpoint_file_must_be(fields, why):
    got = refusal(**fields, job_uid=1000, max_size=16 << 20 if "blocks" in fields else 100)
    assert (got is None) if why is None else (why in got)
    assert refusal(mode=R, nlink=1, uid=0, size=10, job_uid=None, max_size=100) is None, "uid unknown: not checked"


def rtt_table(table):
    return lambda a, b: table.get((a, b), table.get((b, a)))


@pytest.mark.parametrize("source, hosts, table, replica", [
    ("a", ["a", "b", "c"], {("a", "b"): 30.0, ("a", "c"): 10.0}, "c"),
    ("a", ["a", "b", "c"], {("a", "b"): 10.0, ("a", "c"): 10.0}, "b"),  # a tie: the smaller peer id
    ("a", ["a", "c", "b"], {}, "b"),  # nothing known: by peer id
    ("a", ["a", "b", "c"], {("a", "b"): None, ("a", "c"): 500.0}, "c"),  # unknown after any known
    ("a", ["a", "b", "c"], {("a", "b"): math.nan, ("a", "c"): 500.0}, "c"),
    ("a", ["a", "b", "c"], {("a", "b"): -1.0, ("a", "c"): 500.0}, "c"),
    ("a", ["a"], {}, None),  # alone: no replica
    ("a", [], {}, None),
    ("z", ["a", "b"], {("z", "a"): 5.0}, "a"),  # the source need not be among them
])
def test_the_replica_is_the_nearest_other_host(source, hosts, table, replica):
    assert choose_replica(source, hosts, rtt_table(table)) == replica


@pytest.mark.parametrize("items, keep, kept, dropped", [
    ([("x", 1), ("y", 3), ("z", 2)], 2, ["y", "z"], ["x"]),
    ([("x", 1)], 2, ["x"], []),
    ([], 2, [], []),
    ([("x", 1), ("y", 1)], 1, ["y"], ["x"]),  # equal times: by key
    ([("x", 1), ("y", 2)], 0, [], ["y", "x"]),
])
def test_keep_newest(items, keep, kept, dropped):
    assert keep_newest(items, keep) == (kept, dropped)
    assert keep_newest(list(reversed(items)), keep) == (kept, dropped), "in any order"


def _copies(spec: str) -> list[Copy]:
    """"m:a100 m:b100* r:c50 r:~30" -> copies: cache m holds sha a (100 bytes, protected: *),
    ...; ~ is a copy under way. Their mtimes rise in the order written."""
    out = []
    for t, item in enumerate(spec.split()):
        cache, rest = item.split(":")
        protected = rest.endswith("*")
        rest = rest.rstrip("*")
        sha = None if rest[0] == "~" else rest[0]
        out.append(Copy(cache=cache, sha=sha, size=int(rest[1:]), mtime_ns=t, protected=protected))
    return out


@pytest.mark.parametrize("held, cache, size, removed", [
    # room left: any copy fits, nothing goes (first come while there is room)
    ("m:a100 m:b100", "r", 200, []),
    ("m:a100 m:b100", "m", 200, []),
    # issue 23 #4: a member filled the budget; the next job's copy within its share (400 // 2)
    # takes the member's excess back, oldest unprotected first, the protected last
    ("m:a100* m:b100 m:c100 m:d100", "r", 100, ["b"]),
    ("m:a100* m:b100 m:c100 m:d100", "r", 200, ["b", "c"]),
    ("m:a100* m:b100* m:c100* m:d100", "r", 200, ["d", "a"]),
    # the cache furthest over its share (400 // 3 = 133) gives first
    ("m:a100 m:b100 m:c100 n:d100", "r", 100, ["a"]),
    ("m:a100 m:b40 m:c40 n:d110 n:e110", "r", 120, ["d", "a"]),
    # the claimant's own unprotected copies go before anyone's (its prune takes them anyway)
    ("r:x80* r:y80 m:a100 m:b140", "r", 80, ["y"]),
    # a cache within its share is never made to give
    ("n:c100 m:a150 m:b150", "r", 100, ["a"]),
    ("m:a100 n:b100 o:c100 r:x100*", "r", 10, "over its share of 100"),
    # a copy that would take the claimant over its share is refused, nothing removed
    ("m:a100 m:b100 m:c100 m:d100", "r", 300, "over its share of 200"),
    ("r:x100* m:a100 m:b100 m:c100", "r", 150, "this job's cache to 250 bytes, over its share of 200"),
    # copies under way are never removed
    ("m:~200 m:~200", "r", 100, "no other job's cache holds more than its share"),
])
def test_the_budget_is_shared_per_job(held, cache, size, removed):
    plan = make_room(_copies(held), cache, size, 400)
    if isinstance(removed, str):
        assert isinstance(plan, str) and removed in plan and "over their budget of 400" in plan
    else:
        assert [c.sha for c in plan] == removed


@pytest.mark.parametrize("value, why", [
    ("x", "must be a list"),
    ([["a", SHA, 1]] * (MAX_LISTED + 1), "must be a list of at most"),
    ([["a", SHA]], r"checkpoints\[0\]' must be"),
    ([["a/b", SHA, 1]], r"checkpoints\[0\].name"),
    ([["a.tmp", SHA, 1]], r"checkpoints\[0\].name"),
    ([["a", "A" * 64, 1]], r"checkpoints\[0\].sha256"),
    ([["a", SHA, -1]], r"checkpoints\[0\].size"),
    ([["a", SHA, 101]], r"checkpoints\[0\].size"),
    ([["a", SHA, True]], r"checkpoints\[0\].size"),
    ([["a", SHA, 1], ["a", "b" * 64, 2]], "twice"),
])
def test_a_peers_checkpoint_list_is_checked(value, why):
    with pytest.raises(ValueError, match=why):
        check_listed(value, 100)
    assert check_listed([["a", SHA, 1]], 100) == (("a", SHA, 1),) and check_listed(None, 100) == ()


# --- the cache, on real files ---------------------------------------------------------------

JOB_UID = 4242


@pytest.fixture
def rank_dir(tmp_path):
    top = tmp_path / "job"
    top.mkdir(mode=0o711)
    d = top / "checkpoints"
    d.mkdir()
    return top, d


def write(path, data: bytes, uid: int | None = JOB_UID):
    path.write_bytes(data)
    if uid is not None:
        os.chown(path, uid, uid)


def snap(cache: CkptCache, d, name, *, job_uid=JOB_UID, max_size=1 << 20):
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return cache.snapshot(fd, name, seen=listing(fd).get(name), job_uid=job_uid, max_size=max_size)
    finally:
        os.close(fd)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="files of another uid need root")


@needs_root
def test_a_complete_checkpoint_is_copied_by_content_readonly_and_the_daemons(rank_dir):
    top, d = rank_dir
    write(d / "e1.pt", b"weights" * 1000)
    cache = CkptCache(top)
    sha, size = snap(cache, d, "e1.pt")
    assert sha == hashlib.sha256(b"weights" * 1000).hexdigest() and size == 7000
    st = os.lstat(cache.root / sha)
    assert stat.S_IMODE(st.st_mode) == 0o444 and st.st_uid == os.geteuid()
    assert stat.S_IMODE(os.lstat(cache.root).st_mode) == 0o700
    assert cache.path(sha) == cache.root / sha and cache.path("../x") is None and cache.path("b" * 64) is None
    assert [p.name for p in cache.root.iterdir()] == [sha], "no temporary left"


@needs_root
@pytest.mark.parametrize("plant, why", [
    ("symlink", "Too many levels"),
    ("fifo", "not a regular file"),
    ("hardlink", "hard link"),
    ("other_uid", "not the job's"),
    ("oversize", "over this host's checkpoint_max"),
    ("dir", "not a regular file"),
])
def test_what_the_cache_refuses_to_copy(rank_dir, tmp_path, plant, why):
    top, d = rank_dir
    secret = tmp_path / "secret"
    write(secret, b"root's", uid=None)
    match plant:
        case "symlink":
            os.symlink(secret, d / "c")
        case "fifo":
            os.mkfifo(d / "c")
            os.chown(d / "c", JOB_UID, JOB_UID)
        case "hardlink":
            write(secret, b"x", uid=JOB_UID)
            os.link(secret, d / "c")
        case "other_uid":
            write(d / "c", b"x", uid=JOB_UID + 1)
        case "oversize":
            write(d / "c", b"x" * 2000)
        case "dir":
            os.mkdir(d / "c")
            os.chown(d / "c", JOB_UID, JOB_UID)
    cache = CkptCache(top)
    with pytest.raises(CheckpointError, match=why):
        snap(cache, d, "c", max_size=1000)
    assert not cache.root.exists() or list(cache.root.iterdir()) == [], "nothing copied, no temporary left"
    assert secret.read_bytes() in (b"root's", b"x")


@needs_root
def test_names_that_are_not_checkpoint_names_are_never_opened(rank_dir):
    top, d = rank_dir
    with pytest.raises(CheckpointError, match="not a checkpoint name"):
        snap(CkptCache(top), d, "../x")
    with pytest.raises(CheckpointError, match="not a checkpoint name"):
        snap(CkptCache(top), d, "e1.pt.tmp")


@needs_root
def test_a_file_changed_since_it_was_seen_stable_is_not_copied(rank_dir):
    top, d = rank_dir
    write(d / "c", b"one")
    cache = CkptCache(top)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        seen = listing(fd)["c"]
        write(d / "c.tmp", b"two!")
        os.rename(d / "c.tmp", d / "c")
        with pytest.raises(Changed):
            cache.snapshot(fd, "c", seen=seen, job_uid=JOB_UID, max_size=100)
    finally:
        os.close(fd)
    assert cache.shas() == []


@needs_root
def test_installed_checkpoints_are_links_the_job_can_read_and_remove_but_not_change(rank_dir, tmp_path):
    top, d = rank_dir
    src = tmp_path / "got"
    src.write_bytes(b"epoch 3")
    sha = hashlib.sha256(b"epoch 3").hexdigest()
    cache = CkptCache(top)
    cache.store_file(sha, 7, src)
    fresh = top / "fresh"
    fresh.mkdir()
    os.chown(fresh, JOB_UID, JOB_UID)
    known = cache.install(fresh, [("e3.pt", sha, 7)])
    st = os.lstat(fresh / "e3.pt")
    assert st.st_ino == os.lstat(cache.root / sha).st_ino and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o444
    assert known == {"e3.pt": (7, st.st_mtime_ns, st.st_ino)}
    with pytest.raises(CheckpointError, match=f"gone.pt \\({'b' * 12}\\) is not on this host"):
        cache.install(fresh, [("gone.pt", "b" * 64, 7)])
    with pytest.raises(CheckpointError, match="is 7 bytes here, not 8"):
        cache.install(fresh, [("e4.pt", sha, 8)])


@needs_root
def test_store_refuses_bytes_that_are_not_the_sha_or_the_size(rank_dir, tmp_path):
    top, _ = rank_dir
    src = tmp_path / "got"
    src.write_bytes(b"epoch 3")
    cache = CkptCache(top)
    with pytest.raises(CheckpointError, match="not the"):
        cache.store_file("c" * 64, 7, src)
    with pytest.raises(CheckpointError, match="announced"):
        cache.store_file(hashlib.sha256(b"epoch 3").hexdigest(), 6, src)
    assert cache.shas() == [] and not (cache.root.exists() and list(cache.root.iterdir())), "nothing stored, no temporary left"


@needs_root
def test_prune_keeps_the_newest_and_the_protected(rank_dir, tmp_path):
    top, _ = rank_dir
    cache = CkptCache(top)
    shas = []
    for i in range(4):
        src = tmp_path / f"s{i}"
        src.write_bytes(b"%d" % i)
        sha = hashlib.sha256(b"%d" % i).hexdigest()
        cache.store_file(sha, 1, src)
        os.utime(cache.root / sha, ns=(i * 10**9, i * 10**9))
        shas.append(sha)
    assert cache.prune(2, protect={shas[0]}) == [shas[1]]
    assert cache.shas() == sorted([shas[0], shas[2], shas[3]])


@needs_root
def test_a_start_empties_the_job_directory_but_keeps_the_cache(rank_dir, tmp_path):
    top, d = rank_dir
    src = tmp_path / "got"
    src.write_bytes(b"epoch 3")
    sha = hashlib.sha256(b"epoch 3").hexdigest()
    CkptCache(top).store_file(sha, 7, src)
    (d / "e1.pt").write_bytes(b"old")
    (top / "output.log").write_text("old")
    clear_job_dir(top)
    assert [p.name for p in top.iterdir()] == [CACHE_DIR] and CkptCache(top).shas() == [sha]
    assert stat.S_IMODE(os.lstat(top).st_mode) == 0o700
    # a cache directory that is not the daemon's own 0700 one is not trusted
    os.chmod(top / CACHE_DIR, 0o777)
    clear_job_dir(top)
    assert list(top.iterdir()) == []


@needs_root
async def test_the_watcher_tells_a_renamed_checkpoint_once_and_ignores_the_temp_and_the_installed(rank_dir,
                                                                                                  tmp_path):
    top, d = rank_dir
    src = tmp_path / "got"
    src.write_bytes(b"epoch 2")
    old = hashlib.sha256(b"epoch 2").hexdigest()
    cache = CkptCache(top)
    cache.store_file(old, 7, src)
    cache.install(d, [("e2.pt", old, 7)])
    w = Watcher(cache, d, job_uid=JOB_UID, max_size=1 << 20, keep=2, listed=[("e2.pt", old, 7)])
    write(d / "e3.pt.tmp", b"epoch 3 partial")
    assert await w.poll() == [] and await w.poll() == [], "a temp name is never a checkpoint"
    write(d / "e3.pt.tmp", b"epoch 3")
    os.rename(d / "e3.pt.tmp", d / "e3.pt")
    assert await w.poll() == [], "seen once"
    new = hashlib.sha256(b"epoch 3").hexdigest()
    assert await w.poll() == [("e3.pt", new, 7)]
    assert await w.poll() == [], "told once"
    assert cache.path(new) is not None and cache.path(old) is not None


@needs_root
async def test_a_flood_of_checkpoints_at_once_costs_only_the_newest_copies(rank_dir):
    top, d = rank_dir
    for i in range(50):
        write(d / f"e{i:02d}.pt", b"%d" % i)
        os.utime(d / f"e{i:02d}.pt", ns=(i * 10**9, i * 10**9))
    w = Watcher(CkptCache(top), d, job_uid=JOB_UID, max_size=1 << 20, keep=2)
    assert await w.poll() == []
    told = await w.poll()
    assert [name for name, _, _ in told] == ["e48.pt", "e49.pt"]
    assert sorted(CkptCache(top).shas()) == sorted(sha for _, sha, _ in told)
    assert await w.poll() == [], "the older ones are not told later either"


def test_a_sparse_file_is_refused_before_a_byte_is_copied(rank_dir):
    """Reviewer's #8: `truncate -s` makes a file of any length that takes no disk; copying
    it would cost the host its whole length in disk and time."""
    top, d = rank_dir
    with open(d / "ckpt_1", "wb") as f:
        f.truncate(64 << 20)
    cache = CkptCache(top)
    with pytest.raises(CheckpointError, match="sparse: 67108864 bytes long but"):
        snap(cache, d, "ckpt_1", job_uid=None, max_size=128 << 20)
    assert cache.shas() == [] and not (cache.root.exists() and list(cache.root.iterdir()))
    write(d / "ckpt_2", os.urandom(2 << 20), uid=None)  # a real one of its size is copied
    assert snap(cache, d, "ckpt_2", job_uid=None, max_size=128 << 20)[1] == 2 << 20


async def test_the_watcher_copies_at_most_its_rate_a_minute_and_a_checkpoint_over_it_waits_for_room(rank_dir):
    """Reviewer's #8: a job completing checkpoints faster than the host should copy them
    (4 × checkpoint_max a minute) gets the rest copied and told once the minute has room,
    not at once and not never."""
    top, d = rank_dir
    now = [1000.0]
    w = Watcher(CkptCache(top), d, job_uid=None, max_size=100, keep=2, clock=lambda: now[0])
    assert w.rate == 400

    async def complete(*names: str) -> list[str]:
        for i, name in enumerate(names):
            write(d / name, (name.encode() * 20)[:100], uid=None)
            os.utime(d / name, ns=(int(now[0] * 1e9) + i, int(now[0] * 1e9) + i))
        assert await w.poll() == []
        return [name for name, _, _ in await w.poll()]

    assert await complete("a0.pt", "a1.pt") == ["a0.pt", "a1.pt"]
    now[0] += 30
    assert await complete("b0.pt", "b1.pt") == ["b0.pt", "b1.pt"]
    now[0] += 1
    assert await complete("c0.pt", "c1.pt") == [], "400 bytes copied this minute: they wait"
    assert await w.poll() == [] and w.waiting == {"c0.pt", "c1.pt"}
    now[0] += 30  # a0, a1 left the window: room for two
    assert [name for name, _, _ in await w.poll()] == ["c0.pt", "c1.pt"]
    assert await w.poll() == [] and w.waiting == set()


def test_the_listing_stats_only_what_the_directory_types_as_a_regular_file(monkeypatch):
    """Reviewer's #9: a job's FUSE mount at checkpoints/ckpt blocks any stat of it forever;
    the listing must never stat a directory, FIFO, link or socket, only regular files."""
    stated: list[str] = []

    class Entry:
        def __init__(self, name: str, regular: bool) -> None:
            self.name, self.regular = name, regular

        def is_file(self, *, follow_symlinks: bool = True) -> bool:
            assert follow_symlinks is False
            return self.regular

        def stat(self, *, follow_symlinks: bool = True):
            stated.append(self.name)
            assert self.regular, f"stat of {self.name}: would block in a FUSE mount"
            return os.stat_result((stat.S_IFREG | 0o644, 7, 0, 1, 0, 0, 10, 0, 0, 0))

    entries = [Entry("ckpt", False), Entry("fifo.pt", False), Entry("e1.pt", True), Entry("e1.pt.tmp", True)]

    @contextlib.contextmanager
    def scandir(fd):
        yield iter(entries)

    monkeypatch.setattr(os, "scandir", scandir)
    got = listing(3)
    assert list(got) == ["e1.pt"] and got["e1.pt"][0] == 10 and got["e1.pt"][2] == 7
    assert stated == ["e1.pt"]

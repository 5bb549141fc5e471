"""Garbage collection of finished jobs: directories after retention, archives by LRU, .part files."""

from __future__ import annotations

import functools
import os
import time

from swarmd.compute.coordinator import gc
from swarmd.compute.ids import host_dir

OLD = time.time() - 30 * 86400


def aged(path, when=OLD):
    os.utime(path, (when, when), follow_symlinks=False)
    return path


def test_finished_job_dirs_go_after_retention_unless_held_and_other_names_stay(tmp_path):
    current = host_dir("0123456789af", "coord")
    for name in ("0123456789ab", "0123456789ac", "0123456789ad", "0123456789ae-0a1b2c3d", current, "not-a-job",
                 ".hidden", "0123456789ag-0a1b2c3", "0123456789ah-" + "0" * 31 + "G"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "work").mkdir()
        aged(tmp_path / name)
    aged((tmp_path / "0123456789ad"), time.time())  # finished a moment ago
    removed = gc.job_dirs(tmp_path, keep={"0123456789ac"}, before=time.time() - 7 * 86400)
    assert removed == sorted(["0123456789ab", "0123456789ae-0a1b2c3d", current]), \
        "a bare id and an id with 8 hex digits (older daemons), and an id with 32"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "0123456789ac", "0123456789ad",
                                                          "0123456789ag-0a1b2c3", "0123456789ah-" + "0" * 31 + "G",
                                                          "not-a-job"]


def test_a_link_in_a_job_dir_is_removed_not_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "0123456789ab").mkdir()
    os.symlink(outside, jobs / "0123456789ab" / "link")
    os.symlink(outside, jobs / "0123456789ac")
    aged(jobs / "0123456789ab")
    aged(jobs / "0123456789ac")
    assert gc.job_dirs(jobs, keep=(), before=time.time()) == ["0123456789ab", "0123456789ac"]
    assert (outside / "keep").exists()


def test_archives_are_evicted_least_recently_used_first_and_never_a_needed_one(tmp_path):
    for i in range(6):
        p = tmp_path / f"{i:064x}.tar.gz"
        p.write_bytes(b"x" * 100)
        aged(p, OLD + i)
    removed = gc.archives(tmp_path, keep={f"{0:064x}"}, max_count=3)
    assert removed == [f"{i:064x}" for i in (1, 2)], "the oldest go, except the one a live job needs"
    assert gc.archives(tmp_path, keep=(), max_count=10, max_bytes=250) == [f"{0:064x}", f"{3:064x}"]


def test_part_files_go_at_start_and_when_stale(tmp_path):
    (tmp_path / "a.part").write_bytes(b"x")
    aged(tmp_path / "a.part")
    (tmp_path / "b.part").write_bytes(b"x")
    (tmp_path / f"{0:064x}.tar.gz").write_bytes(b"x")
    assert gc.parts(tmp_path, before=time.time() - 3600) == ["a.part"]
    assert gc.parts(tmp_path) == ["b.part"]
    assert [p.name for p in tmp_path.iterdir()] == [f"{0:064x}.tar.gz"]


async def test_collect_removes_what_retention_no_longer_covers_in_its_first_round(tmp_path):
    import trio

    jobs, archive_dir = tmp_path / "jobs", tmp_path / "archives"
    jobs.mkdir()
    archive_dir.mkdir()
    for name in ("0123456789ab", "0123456789ac"):
        (jobs / name).mkdir()
        aged(jobs / name)
    (archive_dir / "x.part").write_bytes(b"x")
    aged(archive_dir / "x.part")
    pruned: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(
            gc.collect, jobs_dir=jobs, archive_dir=archive_dir, retention=86400, held=lambda: ["0123456789ac"],
            needed=lambda: [], prune=lambda before: pruned.append(before) or []))
        with trio.fail_after(5):  # the first round takes milliseconds
            while not pruned or list(archive_dir.iterdir()):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert [p.name for p in jobs.iterdir()] == ["0123456789ac"], "a job still held here is kept"
    assert list(archive_dir.iterdir()) == [] and len(pruned) == 1


def test_a_job_dir_thousands_of_levels_deep_goes_without_taking_the_collector_down(tmp_path):
    """A job can nest directories 3,000 deep; shutil.rmtree recursed, raised RecursionError out
    of the collector, and the daemon died of it at every start."""
    jobs = tmp_path / "jobs"
    top = jobs / "d212aaaaaaaa-00000000"
    top.mkdir(parents=True)
    here = os.getcwd()
    try:
        os.chdir(top)
        for _ in range(3000):
            os.mkdir("d")
            os.chdir("d")
        os.symlink(str(tmp_path / "outside"), "link")
    finally:
        os.chdir(here)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "kept").write_text("x")
    old = time.time() - 10 * 86400
    os.utime(top, (old, old))
    assert gc.job_dirs(jobs, keep=set(), before=time.time() - 86400) == [top.name]
    assert not top.exists() and (tmp_path / "outside" / "kept").exists()

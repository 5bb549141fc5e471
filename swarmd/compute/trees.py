"""Directory trees a peer or a job shaped: removed, copied or handed to a user by the daemon.

A job controls what is in its directory: links, fifos, a tree thousands of levels deep;
a peer controls what a workdir archive unpacks to (workdir.py caps its depth, but a tree
of an older daemon was not). Python's `shutil.rmtree`, `shutil.copytree` and `os.walk`
recurse, and a deep tree raises RecursionError, which is no OSError: it skipped every
clean-up step after it, and out of garbage collection or the workdir cache's start-up
clean-up it stopped the daemon at every start (issue 23, finding 1). This module is the
one door for such trees (tests/test_trees.py fails on a recursive standard-library walk in
swarmd/compute). coreutils walk them instead, and never follow a link:
- `rm -r` and `chown -R` walk with fts, to any depth: `rm` removes a link itself, `chown
  -R -h` (a physical walk, the default) changes the link, not its target.
- `cp -R -P` copies a link as a link. It recurses in C (a few hundred bytes of its 8 MiB
  stack a level): it copies only the workdir cache's trees, whose depth unpacking caps.
Each runs where nothing moves under the walk: the job's processes are gone, or the tree
is the daemon's alone. A failure is a TreeError (an OSError) saying what the tool said.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


class TreeError(OSError):
    """The tree could not be removed, copied or handed over; the message is the tool's."""


def remove(path: Path) -> None:
    """Remove `path`, whatever it is, never following a link, never crossing a mount; a
    path that is not there is no error."""
    _run(["rm", "-rf", "--one-file-system", "--", str(path)])


def copy(src: Path, dest: Path) -> None:
    """Copy the tree `src` to `dest`, which must not exist (cp would copy into it): modes
    and times kept, owned by the daemon, links copied as links, never crossing a mount."""
    if os.path.lexists(dest):
        raise TreeError(f"cp: {dest} exists")
    _run(["cp", "-R", "--no-dereference", "--preserve=mode,timestamps", "--one-file-system",
          "--no-target-directory", "--", str(src), str(dest)])


def give(path: Path, uid: int, gid: int) -> None:
    """Give everything under `path` (itself included) to `uid`:`gid`, links not followed."""
    _run(["chown", "-R", "-h", f"{uid}:{gid}", "--", str(path)])


def hand_back(path: Path, uid: int, to: int) -> None:
    """Give what `uid` owns under `path` (itself included) to `to`, links not followed."""
    _run(["chown", "-R", "-h", f"--from={uid}", f"{to}:{to}", "--", str(path)])


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise TreeError(f"{argv[0]}: {done.stderr.strip()[-500:] or f'exit {done.returncode}'}")

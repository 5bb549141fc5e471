"""Whole directory trees a job wrote, removed or handed back by the daemon (root).

A job controls what is in its directory: links, fifos, a tree thousands of levels deep.
Python's `shutil.rmtree` and `os.walk` recurse (a deep tree raised RecursionError out of
garbage collection, and the daemon died of it at every start). coreutils' `rm` and
`chown` walk with fts, to any depth, and never follow a link: `rm -r` removes the link
itself, `chown -R -h` (physical walk, the default) changes the link, not its target.
Both run only where the job's processes are gone, so nothing moves under the walk.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


class TreeError(OSError):
    """The tree could not be removed or handed back; the message is the tool's."""


def remove(path: Path) -> None:
    """Remove `path`, whatever it is, never following a link, never crossing a mount."""
    _run(["rm", "-rf", "--one-file-system", "--", str(path)])


def hand_back(path: Path, uid: int, to: int) -> None:
    """Give what `uid` owns under `path` (itself included) to `to`, links not followed."""
    _run(["chown", "-R", "-h", f"--from={uid}", f"{to}:{to}", "--", str(path)])


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise TreeError(f"{argv[0]}: {done.stderr.strip()[-500:] or f'exit {done.returncode}'}")

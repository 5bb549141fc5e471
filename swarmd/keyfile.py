"""A private key's file, read one way for the three this daemon keeps (its libp2p identity,
its WireGuard key, a swarm owner's signing key): a regular file of the daemon's uid,
readable by its owner only, else a `KeyFileError` that names the file and what to run."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class KeyFileError(Exception):
    pass


def read_private(path: Path, what: str) -> bytes:
    """The bytes of the private key file `path` (`what`: "identity key", ...), once it
    passes the checks above."""
    try:
        st = path.stat()
    except OSError as exc:
        raise KeyFileError(f"{what} {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{what} {path} is not a regular file: move it away")
    if st.st_mode & 0o077:
        raise KeyFileError(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be readable "
                           f"by its owner only: run `chmod 600 {path}`")
    if st.st_uid != os.geteuid():
        raise KeyFileError(f"{what} {path} belongs to uid {st.st_uid}, not to the daemon's uid "
                           f"{os.geteuid()}: run `chown {os.geteuid()} {path}`")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{what} {path}: {exc.strerror}") from None

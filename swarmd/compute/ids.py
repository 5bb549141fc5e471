"""Job ids: the one format, minted by a coordinator and checked wherever one arrives.

An id is 12 lowercase characters of Crockford's base32 (no i, l, o, u): 42 bits of Unix
milliseconds (good until 2109) then 18 random bits, so ids sort by submission time. Every
id that crosses a boundary (a peer's job request, a role, a path under the jobs directory)
goes through `check_job_id`: nothing else can name a job, so no id is a path, a dot, a
slash, an empty string or a look-alike character.

An id is unique only per coordinator (another member may present an id it learned), so a
host names a job's directory by both: `host_dir(job, coordinator)` is ``<id>-<the first 32
hex digits of sha256(coordinator)>``, and two coordinators' same id never share one. 128
bits, because peer ids are free: with 8 digits (daemons before) a member could make 2^32 keys
until one's hash matched a coordinator's and share its job's directory on every host.
`is_host_dir` takes those older 8-digit names too, so a daemon upgraded in place still
collects what its previous version left (coordinator/gc.py); none is ever made again.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

LENGTH = 12
RANDOM_BITS = 18
ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford's base32, lowercase
_FORMAT = re.compile(f"[{ALPHABET}]{{{LENGTH}}}", re.ASCII)
HOST_HASH = 32  # hex digits of sha256(coordinator) in a job's directory name
_HOST_DIR = re.compile(f"[{ALPHABET}]{{{LENGTH}}}-(?:[0-9a-f]{{{HOST_HASH}}}|[0-9a-f]{{8}})", re.ASCII)


def encode(n: int) -> str:
    """`n` (ms << RANDOM_BITS | random bits) as an id."""
    out = ""
    for _ in range(LENGTH):
        n, digit = divmod(n, 32)
        out = ALPHABET[digit] + out
    return out


def is_job_id(value: Any) -> bool:
    return isinstance(value, str) and _FORMAT.fullmatch(value) is not None


def check_job_id(value: Any, name: str = "job") -> str:
    """`value` if it is a job id; else ValueError naming `name` and the format."""
    if not is_job_id(value):
        shown = repr(value[:40]) + ("…" if len(value) > 40 else "") if isinstance(value, str) else type(value).__name__
        raise ValueError(f"'{name}' must be a job id ({LENGTH} characters of 0-9 and a-z without i, l, o, u); "
                         f"got {shown}")
    return value


def host_dir(job: str, coordinator: str) -> str:
    """The name of a job's directory on a host: its id bound to its coordinator."""
    return f"{check_job_id(job)}-{hashlib.sha256(coordinator.encode()).hexdigest()[:HOST_HASH]}"


def is_host_dir(value: Any) -> bool:
    """Whether `value` names a job's directory: `host_dir`'s, or an older daemon's (8 digits)."""
    return isinstance(value, str) and _HOST_DIR.fullmatch(value) is not None

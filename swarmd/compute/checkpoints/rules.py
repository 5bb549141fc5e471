"""Which files in a rank's `$SWARM_CHECKPOINT_DIR` are checkpoints, and where a copy goes (sans-IO).

The contract for a job is torchrun's elastic one: write a checkpoint under a temporary
name, then rename it into place. The host cannot see a rename happen; it sees directory
listings, four a second (worker.CHECKPOINT_SCAN). Theory of operation:

- A *name* is a checkpoint's when it is 1-128 of ``[A-Za-z0-9._-]``, does not start with a
  dot (hidden: editors, rsync and torch.save's own temporaries) and is not a temporary name
  (``*.tmp``, ``*.part``, ``*.partial``, ``*~``, ``tmp*``). Anything else is never looked
  at: no slash, no NUL, nothing a peer could use as a path.
- A *file* is complete when the same name shows the same (size, mtime_ns, inode) in two
  consecutive scans (`Scan`): a writer that is still appending changes size or mtime
  between scans a quarter second apart, and a rename over the name changes its inode.
  Each complete (name, observation) is reported once; a name rewritten later is reported
  again once it is stable again.
- What the file is (`refusal`): a regular file (never a link, FIFO, socket or device, which
  could block a reader or point outside), with one link (a hard link could be another
  user's file the job cannot read by itself), owned by the job's uid when the host knows
  it, at most the host's `checkpoint_max` bytes, and not sparse (over `SPARSE_MIN` bytes
  long with under half of them on disk: `truncate -s 8G` costs the job nothing and a copy
  8 GiB of the host's disk and time; a checkpoint torch or safetensors writes has no
  holes). The driver checks it on the open file descriptor, not on the name.
- A replica (`choose_replica`): the other alive host of the job nearest the one that wrote
  the checkpoint, so the copy travels the shortest link; RTTs unknown (None, NaN,
  negative) rank after every known one, ties by peer id so every coordinator picks alike.
- Retention (`keep_newest`): the newest `keep` of anything with a time, ties by key.
- Shares (`make_room`): which copies go so a new one fits the host's checkpoint budget, or
  why it does not. While the caches together have room, any copy fits (first come, while
  there is room). Past it, each job's cache is entitled to `share` = budget // the number
  of caches holding anything (the claimant's counted): a claimant whose cache, with the
  copy, stays within its share makes room by removing copies of the other caches over
  their share, the cache furthest over first, in each its unprotected copies oldest first
  and then, while it is still over, its protected ones oldest first (protection counts only
  within a share: else one member could list everything it put in its start and hold the
  whole budget). A claimant over its share, or one for whom that frees too little, is
  refused. The claimant's own unprotected copies go first (its prune after the copy would
  take them anyway), so a job whose checkpoints are at most half its share keeps
  checkpointing. Copies under way (`Copy.sha` None) are never removed.
"""

from __future__ import annotations

import math
import re
import stat
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

NAME = re.compile(r"[A-Za-z0-9._-]{1,128}", re.ASCII)
TEMP_SUFFIXES = (".tmp", ".part", ".partial", "~")
TEMP_PREFIXES = ("tmp",)
SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII)
MAX_LISTED = 16  # checkpoints a start request may name (the newest few are all a restart needs)
SPARSE_MIN = 1024 * 1024  # bytes under which a file is never judged sparse (block rounding, inline data)
KEEP = 2  # checkpoints of a job kept per host: the newest, and the one before in case it is torn

Observation = tuple[int, int, int]  # size, mtime_ns, inode
Rtt = Callable[[str, str], float | None]
K = TypeVar("K", bound=Hashable)


def is_checkpoint_name(name: object) -> bool:
    """Whether `name` may name a complete checkpoint (temporary and hidden names may not)."""
    if not isinstance(name, str) or NAME.fullmatch(name) is None or name.startswith("."):
        return False
    return not (name.endswith(TEMP_SUFFIXES) or name.startswith(TEMP_PREFIXES))


def check_name(value: object, field: str = "name") -> str:
    """`value` if it is a checkpoint name; else ValueError naming `field` and the rule."""
    if not is_checkpoint_name(value):
        raise ValueError(f"'{field}' must be 1-128 of A-Z a-z 0-9 . _ -, not hidden and not a temporary name "
                         "(*.tmp, *.part, *.partial, *~, tmp*)")
    return value  # type: ignore[return-value]


def is_sha256(value: object) -> bool:
    return isinstance(value, str) and SHA256.fullmatch(value) is not None


def check_listed(value: object, max_size: int, field: str = "checkpoints") -> tuple[tuple[str, str, int], ...]:
    """A start request's checkpoints from a peer: at most MAX_LISTED ``[name, sha256, size]``,
    names unique, each a checkpoint name, a sha256 hex digest and 1-`max_size` bytes."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_LISTED:
        raise ValueError(f"'{field}' must be a list of at most {MAX_LISTED} [name, sha256, size]")
    out: list[tuple[str, str, int]] = []
    for i, entry in enumerate(value):
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise ValueError(f"'{field}[{i}]' must be [name, sha256, size]")
        name, sha, size = entry
        check_name(name, f"{field}[{i}].name")
        if not is_sha256(sha):
            raise ValueError(f"'{field}[{i}].sha256' must be 64 lowercase hex digits")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= max_size:
            raise ValueError(f"'{field}[{i}].size' must be an integer from 0 to {max_size}")
        out.append((name, sha, size))
    if len({name for name, _, _ in out}) != len(out):
        raise ValueError(f"'{field}' names a checkpoint twice")
    return tuple(out)


def refusal(*, mode: int, nlink: int, uid: int, size: int, job_uid: int | None, max_size: int,
            blocks: int | None = None) -> str | None:
    """Why an open file (its fstat; `blocks` in 512-byte units) is not a checkpoint the
    host copies, or None."""
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if nlink != 1:
        return f"{nlink} links to it (a hard link is refused)"
    if job_uid is not None and uid != job_uid:
        return f"owned by uid {uid}, not the job's {job_uid}"
    if size > max_size:
        return f"{size} bytes, over this host's checkpoint_max of {max_size}"
    if blocks is not None and size > SPARSE_MIN and blocks * 512 < size // 2:
        return f"sparse: {size} bytes long but {blocks * 512} on disk (a file with holes is refused)"
    return None


class Scan:
    """The two-consecutive-scans rule over a directory's listings.

    `observe` takes one listing, ``{name: (size, mtime_ns, inode)}``, and returns the names
    that are complete now and were not reported with that observation before, oldest
    (mtime) first so the newest checkpoint is the last one told. `retry` forgets a report
    (the driver found the file changed while it copied it): the name is reported again
    once it is stable again. `known` are observations not to report (files the host put
    there itself)."""

    def __init__(self, known: Mapping[str, Observation] | None = None) -> None:
        self._last: dict[str, Observation] = {}
        self._told: dict[str, Observation] = dict(known or {})

    def observe(self, listing: Mapping[str, Observation]) -> list[str]:
        seen = {name: obs for name, obs in listing.items() if is_checkpoint_name(name)}
        ready = [name for name, obs in seen.items() if self._last.get(name) == obs and self._told.get(name) != obs]
        ready.sort(key=lambda name: (seen[name][1], name))
        self._last = seen
        self._told = {name: obs for name, obs in self._told.items() if name in seen}  # bounded by the listing
        for name in ready:
            self._told[name] = seen[name]
        return ready

    def retry(self, name: str) -> None:
        self._told.pop(name, None)


def keep_newest(items: Iterable[tuple[K, float]], keep: int) -> tuple[list[K], list[K]]:
    """(the newest `keep` keys, newest first; the rest) of ``(key, time)`` pairs; equal
    times by key, larger first, so the split is the same in any order."""
    ordered = sorted(items, key=lambda kv: (kv[1], kv[0]), reverse=True)  # type: ignore[arg-type]
    keys = [k for k, _ in ordered]
    keep = max(keep, 0)
    return keys[:keep], keys[keep:]


def choose_replica(source: str, hosts: Iterable[str], rtt_ms: Rtt) -> str | None:
    """The host of `hosts` other than `source` nearest `source` by `rtt_ms`; None when
    there is no other."""
    def distance(peer: str) -> tuple[int, float, str]:
        rtt = rtt_ms(source, peer)
        if rtt is None or isinstance(rtt, bool) or not isinstance(rtt, (int, float)) or math.isnan(rtt) or rtt < 0:
            return (1, 0.0, peer)
        return (0, float(rtt), peer)

    others = sorted({h for h in hosts if h != source}, key=distance)
    return others[0] if others else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Copy:
    """One file a host's checkpoint caches hold (or a copy under way: `sha` None)."""
    cache: str  # the job's directory name (ids.host_dir)
    sha: str | None
    size: int
    mtime_ns: int = 0
    protected: bool = False  # the job's latest start listed it, or its hub keeps it, or it is the newest


def make_room(copies: Iterable[Copy], cache: str, size: int, limit: int) -> list[Copy] | str:
    """The copies to remove so `size` more bytes for `cache` fit the budget `limit` (the
    header's share rule), or why they cannot: the reason names the budget and the share."""
    used: dict[str, int] = {}
    evictable: dict[str, list[Copy]] = {}
    for c in copies:
        used[c.cache] = used.get(c.cache, 0) + c.size
        if c.sha is not None and (c.cache != cache or not c.protected):
            evictable.setdefault(c.cache, []).append(c)
    total = sum(used.values())
    if total + size <= limit:
        return []
    holders = {name for name, n in used.items() if n > 0} | {cache}
    share = limit // len(holders)
    for victims in evictable.values():
        victims.sort(key=lambda c: (c.protected, c.mtime_ns, c.sha or ""))  # unprotected, oldest first
    out: list[Copy] = []

    def remove(name: str) -> None:
        nonlocal total
        gone = evictable[name].pop(0)
        out.append(gone)
        used[name] -= gone.size
        total -= gone.size

    over = (f"a {size}-byte checkpoint would take this host's checkpoint caches to {total + size} bytes, "
            f"over their budget of {limit}")
    while used.get(cache, 0) + size > share and evictable.get(cache):
        remove(cache)  # its own older copies first: the prune after this copy would take them anyway
    if (mine := used.get(cache, 0) + size) > share:
        return (f"{over}, and this job's cache to {mine} bytes, over its share of {share} "
                f"({len(holders)} jobs' caches share the budget)")
    while total + size > limit:
        over_share = [(used[name] - share, name) for name, left in evictable.items()
                      if name != cache and left and used[name] > share]
        if not over_share:
            return f"{over}, and no other job's cache holds more than its share of {share} to give back"
        remove(max(over_share)[1])
    return out

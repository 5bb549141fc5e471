"""Trees and archives that break recursive walks and naive unpacking (issue 23, findings 1,
5, 7), built cheaply and without recursion, and removed the same way (pytest's own clean-up
of tmp_path uses shutil.rmtree: a deep tree left there breaks a later session)."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import tarfile
import zlib
from pathlib import Path

# Deeper than Python's recursion limit (1,000): os.walk and shutil.rmtree raise RecursionError
# on Python 3.11 (3.12's os.walk and 3.13's rmtree no longer recurse, the rest of us still may)
DEEP = 1200


def make_deep(root: Path, depth: int = DEEP) -> Path:
    """`depth` directories named `d`, one inside the other, under `root` (made if missing);
    each made relative to its parent's descriptor, so no path grows past PATH_MAX. Returns
    `root`."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)
    return root


def depth(root: Path) -> int:
    """How many directories named `d` are nested under `root`, counted by descriptors."""
    fd, n = os.open(root, os.O_RDONLY | os.O_DIRECTORY), 0
    try:
        while True:
            try:
                inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                return n
            os.close(fd)
            fd, n = inner, n + 1
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    subprocess.run(["rm", "-rf", "--", str(path)], check=False)


def deep_archive(depth: int = DEEP) -> bytes:
    """A workdir `depth` directories deep, each listed, with a file at the bottom: what a
    member ships in one `workdir` after one `reserve` (~23 KB packed)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for i in range(1, depth + 1):
            info = tarfile.TarInfo("/".join(["d"] * i))
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        info = tarfile.TarInfo("/".join(["d"] * depth + ["f"]))
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    return buf.getvalue()


def empty_files_archive(count: int) -> bytes:
    """A tar.gz of `count` empty files (all named `f`: a host counts entries before it
    creates any), two million in about a second: one MiB of identical headers is deflated
    once, ending in a full flush (a block that refers to nothing before it), and repeated."""
    info = tarfile.TarInfo("f")
    info.mode = 0o644
    header = info.tobuf(format=tarfile.USTAR_FORMAT)
    per_chunk = 2048
    full, rest = divmod(count, per_chunk)
    crc, body = 0, []
    for n, times in ((per_chunk, full), (rest, 1)):
        if not n or not times:
            continue
        chunk = header * n
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        body.append((c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)) * times)
        for _ in range(times):
            crc = zlib.crc32(chunk, crc)
    end = bytes(2 * tarfile.BLOCKSIZE)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    body.append(c.compress(end) + c.flush())
    crc = zlib.crc32(end, crc)
    size = (count * len(header) + len(end)) & 0xFFFFFFFF
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + b"".join(body) + struct.pack("<II", crc, size)

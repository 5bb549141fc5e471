"""Running nftables scripts: the one door through which swarmd changes the kernel's rules.

Users: the job egress firewall (compute/sandbox/firewall.py) and the relay's forwarding rules
(routing/forwarder.py). Their modules build the script text (pure, validated); this one feeds
it to `nft -f -`, where the whole script is one transaction: all of it applies or none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import trio


class NftError(Exception):
    """nft refused a script or cannot run here (the message is nft's)."""


async def apply(script: str, *, nft: Sequence[str] = ("nft",)) -> None:
    """Run `script` as one nftables transaction (`nft -f -`); all of it or nothing.
    `nft` is the command (tests prefix `ip netns exec NS`)."""
    try:
        done = await trio.run_process([*nft, "-f", "-"], stdin=script.encode(), capture_stdout=True,
                                      capture_stderr=True, check=False)
    except OSError as exc:
        raise NftError(f"cannot run {nft[0]}: {exc}") from exc
    if done.returncode != 0:
        raise NftError(done.stderr.decode(errors="replace").strip() or f"nft exited {done.returncode}")


async def tables(family: str, *, nft: Sequence[str] = ("nft",)) -> list[str]:
    """The names of the tables of `family` (`nft -j list tables FAMILY`)."""
    try:
        done = await trio.run_process([*nft, "-j", "list", "tables", family], capture_stdout=True,
                                      capture_stderr=True, check=False)
    except OSError as exc:
        raise NftError(f"cannot run {nft[0]}: {exc}") from exc
    if done.returncode != 0:
        raise NftError(done.stderr.decode(errors="replace").strip() or f"nft exited {done.returncode}")
    try:
        listed = json.loads(done.stdout)["nftables"]
        return [item["table"]["name"] for item in listed if isinstance(item, dict) and "table" in item]
    except (ValueError, KeyError, TypeError) as exc:
        raise NftError(f"nft -j list tables: unreadable output ({exc})") from exc

"""The relay's kernel side: applies routing/nft.py's rules and owns net.ipv4.ip_forward (trio edge).

Rules of this module:
- Forwarding is turned on only after the table is in place: when net.ipv4.ip_forward was
  off, the table drops every forwarded packet that is not a relayed pair's, so there is no
  moment in which the host routes anything else. On close it goes back off first, then
  the table goes.
- "Was it off?" must survive a crash: a daemon killed while relaying leaves ip_forward on
  and its table in place. The table then says so in its comment (nft.FORWARDING_WAS_OFF),
  and the next run reads it: it drops other forwarding again and turns ip_forward back off
  when it closes. `close()` without `start()` cleans such leftovers (relaying now off).
- ip_forward is the daemon's network namespace's (/proc/sys/net/ipv4/ip_forward); `sysctl`
  names a command instead (tests: `ip netns exec NS sysctl`, since /proc/sys/net is the
  namespace of whoever opens it).
- Conntrack entries outlive rules (conntrack.py says why that matters): after a new table
  is in place, the entries of every pair that changed or went are deleted, and all of ours
  when the forwarder starts (a previous run's) and closes. A failed deletion is logged and
  counted, never fatal: the forward chain drops a stale flow anyway.
- Only one change at a time (a lock); a script identical to the one in place is not run again.
  The table is made once (and again when the cap changes, or after an update failed);
  after that a change only refills its rule chains (nft.render(update=True)): the
  bandwidth cap's bucket survives pairs coming and going.
- Which of the relay's addresses are local is read at every apply (`local_ips`; by default
  this namespace's IPv4 addresses): an end's via_ip that is not local is the public
  address of a 1:1 NAT in front of the relay (nft.py).
- ip_forward goes back off at close only if it still holds the 1 this daemon wrote; if
  someone changed it meanwhile it is theirs now: left alone, and logged.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import psutil
import structlog
import trio

from ..nft import NftError, apply
from . import conntrack
from . import nft as rules
from .relay import PORTS, Pair

log = structlog.get_logger("swarmd.routing")

PROC_IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
CLOSE_TIMEOUT = 10.0  # seconds close() may take even when cancelled (it undoes kernel state)


def own_ipv4() -> list[str]:
    """This network namespace's IPv4 addresses (every interface's)."""
    return sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET})


class Forwarder:
    def __init__(self, table: str, *, cap_bytes_per_s: int, ports: tuple[int, int] = PORTS,
                 nft: Sequence[str] = ("nft",),
                 sysctl: Sequence[str] | None = None, ip_forward: Path = PROC_IP_FORWARD,
                 flush_conntrack: bool = True, netns: str | None = None,
                 local_ips: Callable[[], Iterable[str]] = own_ipv4) -> None:
        """`nft`, `sysctl`, `netns` (a path like /run/netns/NAME, for the conntrack socket) and
        `local_ips` reach another network namespace than the daemon's (tests);
        `flush_conntrack=False` without root."""
        rules.render(table, (), ports=ports, cap_bytes_per_s=cap_bytes_per_s, drop_other_forwarding=True)  # checks
        self.table = table
        self.ports = ports
        self.cap_bytes_per_s = cap_bytes_per_s
        self.nft = tuple(nft)
        self.sysctl = None if sysctl is None else tuple(sysctl)
        self.ip_forward = ip_forward
        self.flush_conntrack = flush_conntrack
        self.netns = netns
        self.local_ips = local_ips
        self.conntrack_errors = 0  # deletions that failed (status)
        self.forwarding_was_off: bool | None = None  # None: not known yet (not started)
        self.started = False  # the table is in place and forwarding on
        self.applied = 0  # scripts run (status, tests)
        self._pairs: tuple[Pair, ...] = ()
        self._in_place: dict[int, Pair] = {}  # port -> the pair the table in place forwards there
        self._script: str | None = None  # the table in place, as a whole-table script
        self._made: tuple[int, bool] | None = None  # (cap, drop_other_forwarding) the table was made with
        self._lock = trio.Lock()

    async def start(self) -> None:
        """Install the table (with the pairs given so far), then turn forwarding on."""
        async with self._lock:
            await self._start()

    async def apply(self, pairs: Iterable[Pair]) -> bool:
        """Forward exactly `pairs` from now on (starting first if needed). True if the rules changed."""
        pairs = tuple(pairs)
        async with self._lock:
            self._pairs = pairs
            if not self.started:
                await self._start()
                return True
            if not await self._run():
                return False
            now = {p.port: p for p in pairs}
            stale, self._in_place = [port for port, was in self._in_place.items() if now.get(port) != was], now
            await self._forget(stale)  # a pair gone or changed (an end at a new address): its flows too
            return True

    async def close(self) -> None:
        """ip_forward back off if this daemon (or a crashed run of it) turned it on, then the
        table removed, then its flows' conntrack entries. Runs even when cancelled (bounded by
        CLOSE_TIMEOUT); raises NftError or OSError after trying all."""
        with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_TIMEOUT):
            async with self._lock:
                was_off = self.forwarding_was_off
                if was_off is None:
                    was_off = await self._left_off()
                self.forwarding_was_off, self.started, self._script, self._pairs = None, False, None, ()
                self._in_place, self._made = {}, None
                failed: Exception | None = None
                if was_off:
                    try:
                        if await self._read():
                            await self._write(False)
                        else:  # someone turned it off meanwhile: theirs now
                            log.warning("relay: net.ipv4.ip_forward is no longer the 1 this daemon wrote; left as is")
                    except (OSError, NftError) as exc:
                        failed = exc
                try:
                    await apply(rules.delete(self.table), nft=self.nft)
                except NftError as exc:
                    failed = failed or exc
                await self._forget(None)  # what the table NATed goes on being NATed without it
                if failed is not None:
                    raise failed

    # --- inside ----------------------------------------------------------------------------

    async def _start(self) -> None:
        if self.started:
            return
        on = await self._read()
        if self.forwarding_was_off is None:  # known before anything changes: close() undoes a partial start
            self.forwarding_was_off = not on or await self._left_off()
        await self._run()
        await self._forget(None)  # a previous run's flows, made by rules that are gone
        self._in_place = {p.port: p for p in self._pairs}
        if not on:
            await self._write(True)
        self.started = True

    def _render(self, local: tuple[str, ...], *, update: bool = False) -> str:
        return rules.render(self.table, self._pairs, ports=self.ports, cap_bytes_per_s=self.cap_bytes_per_s,
                            drop_other_forwarding=bool(self.forwarding_was_off), local=local, update=update)

    async def _run(self) -> bool:
        """Put the table for the pairs in place: its rule chains only when the table was made with
        the same cap and policy (the cap's bucket lives on), else the whole table. False if the
        table in place is that already."""
        local = tuple(self.local_ips())
        script = self._render(local)
        if script == self._script:
            return False
        made = (self.cap_bytes_per_s, bool(self.forwarding_was_off))
        try:
            if self._made != made:
                raise NftError("the table is made anew")
            await apply(self._render(local, update=True), nft=self.nft)
        except NftError as exc:
            if self._made == made:  # the table went (someone deleted it?): made anew
                log.warning("relay: updating the rules failed, replacing the table", error=str(exc))
            self._made = None
            await apply(script, nft=self.nft)
            self._made = made
        self._script = script
        self.applied += 1
        return True

    async def _forget(self, ports: list[int] | None) -> None:
        """Delete the conntrack entries of the pairs on `ports` (None: of every pair)."""
        if not self.flush_conntrack or ports == []:
            return
        marks = [(rules.MARK, rules.MARK_MASK)] if ports is None else [(rules.mark(p), 0xFFFFFFFF) for p in ports]
        for mark, mask in marks:
            try:
                await trio.to_thread.run_sync(functools.partial(conntrack.delete_by_mark, mark, mask, netns=self.netns))
            except OSError as exc:
                self.conntrack_errors += 1
                log.warning("relay: cannot delete conntrack entries", mark=f"0x{mark:08x}", error=str(exc))

    async def _left_off(self) -> bool:
        """Whether a table of ours left by an earlier run says it turned forwarding on."""
        try:
            done = await trio.run_process([*self.nft, "list", "table", "ip", self.table], capture_stdout=True,
                                          capture_stderr=True, check=False)
        except OSError as exc:
            raise NftError(f"cannot run {self.nft[0]}: {exc}") from exc
        return done.returncode == 0 and rules.FORWARDING_WAS_OFF in done.stdout.decode(errors="replace")

    async def _read(self) -> bool:
        if self.sysctl is None:
            text = await trio.Path(self.ip_forward).read_text()
        else:
            text = await self._sysctl("-n", "net.ipv4.ip_forward")
        return text.strip() != "0"

    async def _write(self, on: bool) -> None:
        value = "1" if on else "0"
        if self.sysctl is None:
            await trio.Path(self.ip_forward).write_text(value + "\n")
        else:
            await self._sysctl("-qw", f"net.ipv4.ip_forward={value}")

    async def _sysctl(self, *args: str) -> str:
        done = await trio.run_process([*self.sysctl, *args], capture_stdout=True, capture_stderr=True, check=False)
        if done.returncode != 0:
            raise OSError(f"{' '.join(self.sysctl)} {' '.join(args)}: {done.stderr.decode(errors='replace').strip()}")
        return done.stdout.decode()

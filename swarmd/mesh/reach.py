"""The reach driver: asks members how they see this node, and answers them (wg/reach.py's I/O).

Protocol ``/swarmd/reach/1.0.0``, one request and one answer per stream, members only
(both ways): ``{cert, port}`` -> ``{seen}``, an attestation signed by the observer
(reach.seal_seen) of
- ``wg``: where the asker's WireGuard packets come from, as the observer's own device
  authenticated them (``Mesh.observed_endpoint``), or None;
- ``ip``: the address the asker's libp2p connection comes from (None over the overlay);
- ``dial``: whether a fresh TCP connection to ``ip:port`` reached a libp2p listener (the
  multistream header answers). Only the asker's own address is dialled, never one it names,
  at most once per ``DIAL_EVERY`` seconds per asker and ``DIALS_PER_S`` in all, so nobody can
  aim the observer at a victim; a refused dial-back is answered without ``dial`` (counted).
  An asker gets ``ASKS_PER_S`` answers a second (a burst of ``ASK_BURST``), beyond which it is
  refused (counted ``ask_rate``): each answer costs a device read and a signature.

The asker (``run``) asks ``OBSERVERS`` members, those whose records say they are public
first, every ``ASK_EVERY`` seconds (``ASK_EVERY_UNKNOWN`` while the verdict is unknown);
a verdict that changes makes gossip reissue our record: the mesh puts it in (nat,
reflexive endpoint, the attestations) and node.py's announced addresses follow it (nobody
can dial a node that is not public: it announces none, and is dialled at its overlay
address instead).
"""

from __future__ import annotations

import ipaddress
import random
import time
from collections.abc import Callable
from typing import Any

import structlog
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from ..gossip.membership import State
from ..p2p.host import remote_ip
from ..p2p.limits import TokenBuckets
from ..p2p.signed import Invalid
from ..p2p.streams import PeerError, close_quietly, read_frame, request, write_frame
from ..rpc.framing import FrameTooLarge
from ..wg import reach

log = structlog.get_logger("swarmd.reach")

PROTOCOL = "/swarmd/reach/1.0.0"
OBSERVERS = 3  # asked per round: the quorum (2) and one to spare for a liar or a slow one
# seconds between rounds once known: a rebinding shows within one, and a peer whose NAT filters by
# port reaches a rebound node again only once its record names the new mapping (the bench: 21 s to
# the new verdict at 20 s); 3 asks per 10 s is nothing to an observer
ASK_EVERY = 10.0
ASK_EVERY_UNKNOWN = 2.0
TIMEOUT = 5.0  # for one answer, dial-back included
DIAL_TIMEOUT = 2.0
DIAL_EVERY = 10.0  # seconds between dial-backs for one asker
DIALS_PER_S = 5.0  # dial-backs in all, whoever asks
# answers per asker: each costs a read of the WireGuard device and a signature; an honest asker
# asks one observer at most every ASK_EVERY_UNKNOWN seconds
ASKS_PER_S, ASK_BURST = 1.0, 5.0
MULTISTREAM = b"\x13/multistream/1.0.0\n"
MAX_FRAME = 4096


class Reachability:
    def __init__(self, *, transport: Any, gossip: Any, mesh: Any, sign: Callable[[bytes], bytes], reject: Any,
                 network: str, rng: random.Random) -> None:
        self.rng = rng
        self.transport = transport
        self.g = gossip
        self.mesh = mesh
        self.sign = sign
        self.reject = reject  # (reason, peer, detail): the reach subsystem's refusals
        self.network = ipaddress.ip_network(network)
        self.judge = reach.Reach(wg_port=mesh.port)
        self.verdict = reach.UNKNOWN
        self.port: int | None = None  # our libp2p TCP port, for dial-backs
        self.asked = self.answered = self.dialled = 0
        self._dial_per_asker = TokenBuckets(1 / DIAL_EVERY, 1.0, size=4096)
        self._dials = TokenBuckets(DIALS_PER_S, DIALS_PER_S, size=1)
        self._asks = TokenBuckets(ASKS_PER_S, ASK_BURST, size=4096)
        self._advertised = 0.0  # when a verdict's attestations last went into our record
        self._dial_asked: dict[str, float] = {}  # observer -> when we last asked it to dial back

    def current(self) -> reach.Verdict:
        return self.verdict

    def public(self) -> bool:
        """Whether to announce our underlay addresses: unless members found nobody can dial them."""
        return self.verdict.kind in ("public", "unknown")

    # --- the asker ------------------------------------------------------------------------

    async def run(self, local_ips: Callable[[], list[str]], port: int | None) -> None:
        self.port = port
        self.transport.serve(PROTOCOL, self.handle, reject=self.reject, per_peer=4)
        while True:
            try:
                await self.round(local_ips())
            except Exception:  # a bug here must not take the daemon down: the next round tries again
                log.exception("reach round failed")
            await trio.sleep(ASK_EVERY_UNKNOWN if self.verdict.kind == "unknown" else ASK_EVERY)

    async def round(self, local_ips: list[str]) -> None:
        if self.g.swarm is None or not getattr(self.mesh, "started", False):
            return
        self.judge.set_local_ips(local_ips)
        observers = self._observers()
        async with trio.open_nursery() as nursery:
            for peer in observers:
                nursery.start_soon(self._ask, peer)
        self._decide()

    def _observers(self) -> list[str]:
        """Members to ask: alive, with a mesh side; first those found public (their dial-back
        means something), then those we hold a libp2p connection to (a NATed node's, to the
        members it dialled), then those announcing addresses (dialable, unless found otherwise);
        shuffled within each kind. A member behind a NAT is reached only over the overlay,
        which may not be up yet."""
        members = [m for m in self.g.view() if m.state == State.ALIVE and m.record.wg is not None]
        self.rng.shuffle(members)
        members.sort(key=lambda m: (m.record.wg.nat != "public", not self.transport.remote_ips(m.peer),
                                    not m.record.addrs))
        return [m.peer for m in members[:OBSERVERS]]

    async def _ask(self, peer: str) -> None:
        self.asked += 1
        req: dict[str, Any] = {"cert": self.g.swarm.cert.blob}
        now = trio.current_time()
        if self.port is not None and now - self._dial_asked.get(peer, -DIAL_EVERY) > DIAL_EVERY:
            self._dial_asked[peer] = now  # the observer rations dial-backs per asker: ask within its rate
            req["port"] = self.port
        reply = None
        with trio.move_on_after(TIMEOUT):
            try:
                reply = await request(self.transport.host, ID.from_base58(peer), PROTOCOL, req, MAX_FRAME)
            except PeerError:
                return
            except FrameTooLarge as exc:  # not a PeerError: out of here, it cut the round's other asks short
                self.reject("too_large", peer, f"reach answer: {exc}")
                return
        if not isinstance(reply, dict) or "seen" not in reply:
            return
        try:
            seen = reach.open_seen(reply["seen"], swarm=self.g.swarm.swarm, about=self.g.me,
                                   wgpub=self.mesh.keys.public, now=time.time())
        except Invalid as exc:
            self.reject(exc.reason, peer, f"reach answer: {exc.detail}")
            return
        if seen.observer != peer:
            self.reject("mismatch", peer, "reach answer signed by another member")
            return
        self.answered += 1
        self.judge.observed(seen)
        self._decide(partial=True)  # at each answer: a slow or hung observer must not hold the verdict back

    def _decide(self, *, partial: bool = False) -> None:
        """The verdict from every observation in the window, at the end of a round and at each
        answer (``partial``). Mid-round it never turns unknown: observations that expired while
        the node did not ask (a pause) would flip it to unknown and back within one round."""
        verdict = self.judge.verdict(time.time())
        if partial and verdict.kind == "unknown":
            return
        before = self.verdict
        self.verdict = verdict
        now = time.time()
        if (verdict.kind, verdict.reflexive) != (before.kind, before.reflexive):
            log.info("reachability", reach=verdict.label, reflexive=verdict.reflexive,
                     confirmed_by=list(verdict.confirmed_by), was=before.label)
            self.g.readvertise()
            self._advertised = now
        elif verdict.seen != before.seen and verdict.kind not in ("public", "unknown") \
                and now - self._advertised > reach.SEEN_TTL / 2:
            self.g.readvertise()  # fresh attestations, well before the old ones expire (not every round)
            self._advertised = now

    # --- the observer ---------------------------------------------------------------------

    async def handle(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(TIMEOUT + 5):
                req = await read_frame(stream, MAX_FRAME)
                if not await self.g.check_member(req, peer, stream):
                    return
                if not self._asks.allow(str(peer), trio.current_time()):
                    self.reject("ask_rate", str(peer), "reach request: asked too often")
                    await write_frame(stream, {"error": "asked too often"})
                    return
                await write_frame(stream, await self._answer(str(peer), stream, req))
        except FrameTooLarge as exc:
            self.reject("too_large", str(peer), f"reach request: {exc}")
        except (PeerError, trio.TooSlowError) as exc:
            self.reject("malformed", str(peer), f"reach request: {exc.__class__.__name__}: {exc}")
        finally:
            await close_quietly(stream)

    async def _answer(self, peer: str, stream: INetStream, req: dict[str, Any]) -> dict[str, Any]:
        m = self.g.view().get(peer)
        wg = m.record.wg if m is not None else None
        if wg is None:
            self.reject("not_member", peer, "reach request from a member with no mesh side in the view")
            return {"error": "no record of yours with a mesh side yet"}
        endpoint = await self.mesh.observed_endpoint(peer)
        ip = remote_ip(stream.muxed_conn)
        if ip is not None and ipaddress.ip_address(ip) in self.network:
            ip = None  # over the overlay: says nothing of the underlay
        dial = None
        port = req.get("port")
        if ip is not None and port is not None:
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                self.reject("malformed", peer, f"reach request: port {port!r:.20}")
            elif not self._dial_per_asker.allow(peer, trio.current_time()) \
                    or not self._dials.allow("all", trio.current_time()):
                self.reject("dial_rate", peer, "reach request: dial-back asked too often")
            else:
                dial = await dial_back(ip, port)
                self.dialled += 1
        seen = reach.seal_seen(self.sign, swarm=self.g.swarm.swarm, observer=self.g.me, about=peer,
                               wgpub=wg.public, wg=endpoint, ip=ip, dial=dial, at=time.time())
        return {"seen": seen}

    def status(self) -> dict[str, Any]:
        v = self.verdict
        return {"reach": v.label, "nat": v.kind, "reflexive": v.reflexive, "confirmed_by": list(v.confirmed_by),
                "port_mapping": None, "observations": [
                    {"observer": s.observer, "wg": s.wg, "ip": s.ip, "dial": s.dial,
                     "age_s": round(time.time() - s.at, 1)}
                    for s in self.judge.observations(time.time())],
                "asked": self.asked, "answered": self.answered, "dialled_back": self.dialled}


async def dial_back(ip: str, port: int) -> bool:
    """Whether a fresh TCP connection to ``ip:port`` reaches a libp2p listener: it answers
    multistream-select's header with its own."""
    with trio.move_on_after(DIAL_TIMEOUT):
        try:
            stream = await trio.open_tcp_stream(ip, port)
        except OSError:
            return False
        try:
            await stream.send_all(MULTISTREAM)
            got = b""
            while len(got) < len(MULTISTREAM):
                chunk = await stream.receive_some(len(MULTISTREAM) - len(got))
                if not chunk:
                    return False
                got += chunk
            return got == MULTISTREAM
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()
    return False

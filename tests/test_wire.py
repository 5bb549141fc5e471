import pytest
from nacl.signing import SigningKey

from swarmd.gossip.capacity import Gpu, Resources
from swarmd.gossip.cert import CLOCK_SKEW, issue_cert, swarm_id
from swarmd.p2p.signed import Invalid, peer_from_key, peer_str, seal
from swarmd.gossip.wire import (MAX_ADDRS, MAX_LABELS, MAX_MESSAGE, MAX_SEQ, RUMOR_TTL, MeshInfo, Record, Rumor, Verifier, check_labels,
                                make_record, make_rumor, only_loopback, wg_proof_message)
from swarmd.wg.address import ula
from swarmd.wg.keys import KeyPair, prove

OWNER = SigningKey(b"\x0a" * 32)
OWNER_PUBLIC = bytes(OWNER.verify_key)
SWARM = swarm_id(OWNER_PUBLIC)
NODE = SigningKey(b"\x01" * 32)
PEER = peer_from_key(bytes(NODE.verify_key))
OTHER = SigningKey(b"\x02" * 32)
OTHER_PEER = peer_from_key(bytes(OTHER.verify_key))
STRANGER = SigningKey(b"\x0b" * 32)
NOW = 1_700_000_000.0
RES = Resources(cpu_count=8, cpu_free=6.5, memory_total_mb=32000, memory_free_mb=20000, gpus=(
    Gpu(index=0, name="NVIDIA A100-SXM4-80GB", uuid="GPU-aaaa", memory_total_mb=81920, memory_free_mb=80000,
        utilization_pct=3, compute_capability="8.0"),))
ADDRS = ["/ip4/192.0.2.1/tcp/4001"]


def signer(key):
    return lambda data: key.sign(data).signature


def cert_for(peer=PEER, *, owner=OWNER, swarm=SWARM, issued=NOW - 86400, ttl=365 * 86400.0):
    return issue_cert(signer(owner), swarm, peer, now=issued, ttl=ttl)


CERT = cert_for()
WG_KEY = KeyPair.from_private(bytes(range(32)))
MESH = MeshInfo(public=WG_KEY.public, addr4="10.211.3.4", addr6=str(ula(SWARM, peer_str(PEER).encode())), port=51820,
                endpoints=("192.0.2.1", "2001:db8::1"),
                proof=prove(WG_KEY.private, wg_proof_message(SWARM, peer_str(PEER), WG_KEY.public)))
VERIFIER = Verifier(SWARM, OWNER_PUBLIC)


def record(**kw):
    args = dict(swarm=SWARM, peer=peer_str(PEER), seq=(3 << 32) + 7, issued=NOW - 1, ttl=120.0, addrs=ADDRS,
                resources=RES, labels={"zone": "eu-west", "example.com/tier": "gold"},
                wg=MESH, cert=CERT)
    key = kw.pop("key", NODE)
    args.update(kw)
    return make_record(signer(key), **args)


def rumor(kind="suspect", **kw):
    args = dict(kind=kind, swarm=SWARM, sender=peer_str(PEER), about=peer_str(OTHER_PEER), incarnation=42,
                issued=NOW - 1, cert=CERT)
    key = kw.pop("key", NODE)
    args.update(kw)
    return make_rumor(signer(key), **args)


def record_body(**changes):
    """A record's body as make_record writes it; a value of ... removes the field."""
    body = {"v": 1, "k": "record", "swarm": SWARM, "peer": PEER, "seq": 7, "issued": NOW - 1, "ttl": 120.0,
            "addrs": ADDRS, "res": RES.to_wire(), "labels": {}, "wg": None, "cert": CERT.blob}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not ...}


def rumor_body(**changes):
    body = {"v": 1, "k": "suspect", "swarm": SWARM, "peer": PEER, "about": OTHER_PEER, "inc": 42,
            "issued": NOW - 1, "cert": CERT.blob}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not ...}


def sealed(body, key=NODE):
    return seal(body, signer(key))


def decode(blob, now=NOW):
    return VERIFIER.decode(blob, now)


def reason(blob, now=NOW):
    with pytest.raises(Invalid) as err:
        decode(blob, now)
    return err.value.reason


def test_good_record():
    blob = record()
    rec = decode(blob)
    assert isinstance(rec, Record)
    assert rec == Record(swarm=SWARM, peer=peer_str(PEER), seq=(3 << 32) + 7, issued=NOW - 1, ttl=120.0,
                         addrs=tuple(ADDRS), resources=RES, labels={"zone": "eu-west", "example.com/tier": "gold"},
                         wg=MESH, cert=CERT, blob=blob)
    assert rec.expires == NOW + 119.0


def test_record_without_optional_fields():
    rec = decode(sealed(record_body(labels=..., wg=...)))
    assert rec.labels == {} and rec.wg is None


def test_unknown_fields_are_ignored():
    assert decode(sealed(record_body(future={"x": 1}))).seq == 7


@pytest.mark.parametrize("kind", ["suspect", "dead"])
def test_good_rumor(kind):
    blob = rumor(kind)
    got = decode(blob)
    assert got == Rumor(kind=kind, swarm=SWARM, sender=peer_str(PEER), about=peer_str(OTHER_PEER), incarnation=42,
                        issued=NOW - 1, blob=blob)


def test_left_is_about_the_sender():
    got = decode(sealed(rumor_body(k="left", about=...)))
    assert (got.kind, got.sender, got.about) == ("left", peer_str(PEER), peer_str(PEER))
    # and an "about" in a left rumor cannot make it about someone else
    assert decode(sealed(rumor_body(k="left", about=OTHER_PEER))).about == peer_str(PEER)


def test_too_large():
    assert reason(b"\x00" * (MAX_MESSAGE + 1)) == "too_large"
    big = sealed(record_body(padding="x" * MAX_MESSAGE))
    assert reason(big) == "too_large"


def test_bad_signature():
    blob = record()
    assert reason(blob.replace(b"eu-west", b"eu-east")) == "signature"


def test_signed_by_someone_else_in_the_signers_name():
    assert reason(record(key=OTHER)) == "signature"  # OTHER signs, the body says PEER
    assert reason(rumor(key=STRANGER)) == "signature"


def test_signature_checked_before_certificate():
    # a forger without the key learns nothing about which certificates are good
    assert reason(record(key=OTHER, cert=cert_for(owner=STRANGER))) == "signature"


@pytest.mark.parametrize("version", [0, 2, "1", None, ...])
def test_unknown_version(version):
    assert reason(sealed(record_body(v=version))) == "version"
    assert reason(sealed(rumor_body(v=version))) == "version"


def test_foreign_swarm():
    other_swarm = swarm_id(bytes(STRANGER.verify_key))
    assert reason(record(swarm=other_swarm)) == "swarm"
    assert reason(rumor(swarm=other_swarm)) == "swarm"
    assert reason(sealed(record_body(swarm=...))) == "swarm"


@pytest.mark.parametrize("cert", [
    pytest.param(..., id="missing"),
    pytest.param(None, id="none"),
    pytest.param(b"not a cert", id="garbage"),
    pytest.param(cert_for(OTHER_PEER).blob, id="another-peers"),
    pytest.param(cert_for(owner=STRANGER).blob, id="not-the-owners"),
    pytest.param(cert_for(owner=STRANGER, swarm=swarm_id(bytes(STRANGER.verify_key))).blob, id="another-swarms"),
    pytest.param(cert_for(swarm="0123456789abcdef").blob, id="owner-signed-for-another-swarm"),
    pytest.param(cert_for(issued=NOW - 7200, ttl=3600).blob, id="expired"),
    pytest.param(cert_for(issued=NOW + CLOCK_SKEW + 60).blob, id="issued-in-the-future"),
])
def test_bad_certificate(cert):
    assert reason(sealed(record_body(cert=cert))) == "cert"
    assert reason(sealed(rumor_body(cert=cert))) == "cert"


@pytest.mark.parametrize("issued, ttl, ok", [
    (NOW - 1, 120.0, True),
    (NOW - 120, 120.0, True),  # expires now: still good this instant
    (NOW - 121, 120.0, False),
    (NOW - 86400, 120.0, False),
    (NOW - 1, -5.0, False),
    (NOW + CLOCK_SKEW, 120.0, True),  # a fast clock is tolerated
])
def test_record_freshness(issued, ttl, ok):
    blob = sealed(record_body(issued=issued, ttl=ttl))
    if ok:
        assert decode(blob).issued == issued
    else:
        assert reason(blob) == "stale"


@pytest.mark.parametrize("age, ok", [(0, True), (RUMOR_TTL - 1, True), (RUMOR_TTL, True), (RUMOR_TTL + 1, False),
                                     (3600, False)])
def test_rumor_freshness(age, ok):
    for kind in ("suspect", "dead", "left"):
        blob = sealed(rumor_body(k=kind, issued=NOW - age))
        if ok:
            assert decode(blob).kind == kind
        else:
            assert reason(blob) == "stale"


@pytest.mark.parametrize("body", [record_body(issued=NOW + CLOCK_SKEW + 1), rumor_body(issued=NOW + 3600)])
def test_issued_in_the_future(body):
    assert reason(sealed(body)) == "future"


@pytest.mark.parametrize("issued", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_times(issued):
    # NaN compares false with everything: it must not slip past the freshness checks
    assert reason(sealed(rumor_body(issued=issued))) == "malformed"
    assert reason(sealed(record_body(issued=issued))) == "malformed"


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), 86400.5, 1e15])
def test_non_finite_or_endless_ttl(ttl):
    """A record must go stale once its node stops publishing: a ttl of 10^15 s never would."""
    assert reason(sealed(record_body(ttl=ttl))) == "malformed"


@pytest.mark.parametrize("labels", [
    {"Zone": "eu"},
    {"bad key": "x"},
    {"-zone": "x"},
    {"zone-": "x"},
    {"": "x"},
    {"z" * 64: "x"},
    {"zone": 5},
    {"zone": None},
    {"zone": "x" * 256},
    {"zone": "eu\x1b]52;c;cm0gLXJmIH4K\x07"},  # an OSC 52 clipboard write on every operator's terminal
    {"zone": "ok\rsucceeded"},
    {"zone": "\u202eue"},  # a bidi override: the reader sees other text than there is
    {f"l{i}": "x" for i in range(MAX_LABELS + 1)},
    ["zone", "eu"],
    "zone=eu",
])
def test_bad_labels(labels):
    assert reason(sealed(record_body(labels=labels))) == "malformed"


@pytest.mark.parametrize("labels", [
    {},
    {"a": ""},
    {"z" * 63: "x" * 255},
    {"example.com/gpu-class": "a100", "x_y": "1", "0": "digit"},
    {"zone": "[/x] [bold]eu[/bold]"},  # markup is text: shown as written (swarmctl draws it as text)
    {"city": "Zürich 東京"},
    {f"l{i}": "x" for i in range(MAX_LABELS)},
])
def test_good_labels(labels):
    assert decode(sealed(record_body(labels=labels))).labels == labels
    assert check_labels(labels) == labels


def test_check_labels_names_the_key():
    with pytest.raises(Invalid, match=r"^malformed: labels: key 'Zone' must be"):
        check_labels({"Zone": "x"})
    with pytest.raises(Invalid, match=r"^malformed: config.labels.zone: value must be printable text"):
        check_labels({"zone": 1}, "config.labels")


@pytest.mark.parametrize("res, where", [
    (..., "record.resources: expected a map"),
    ("8 cpus", "record.resources: expected a map"),
    ({**RES.to_wire(), "cpu_count": -1}, "record.resources.cpu_count"),
    ({**RES.to_wire(), "gpus": [{**RES.to_wire()["gpus"][0], "memory_free_mb": "lots"}]},
     "record.resources.gpus[0].memory_free_mb"),
])
def test_bad_resources(res, where):
    with pytest.raises(Invalid) as err:
        decode(sealed(record_body(res=res)))
    assert err.value.reason == "malformed"
    assert err.value.detail.startswith(where), err.value.detail


@pytest.mark.parametrize("changes", [
    {"k": "gossip"},
    {"k": ...},
    {"peer": ...},
    {"peer": peer_str(PEER)},  # text, not bytes
    {"peer": b"\x00" * 38},  # not an Ed25519 peer id
    {"issued": ...},
    {"issued": "now"},
    {"ttl": ...},
    {"ttl": True},
    {"seq": ...},
    {"seq": -1},
    {"seq": 1.0},
    {"seq": True},
    {"addrs": ...},
    {"addrs": "/ip4/192.0.2.1/tcp/4001"},
    {"addrs": [1]},
    {"addrs": ["/ip4/192.0.2.1/tcp/4001/" + "x" * 256]},
    {"addrs": [f"/ip4/192.0.2.{i}/tcp/4001" for i in range(MAX_ADDRS + 1)]},
    {"wg": "wireguard"},
    {"wg": []},
    {"wg": {**MESH.to_wire(), "pub": b"short"}},
    {"wg": {**MESH.to_wire(), "port": 0}},
    {"wg": {**MESH.to_wire(), "port": True}},
    {"wg": {**MESH.to_wire(), "addr4": "10.211.0.300"}},
    {"wg": {**MESH.to_wire(), "addr6": "fd00::zz"}},
    {"wg": {**MESH.to_wire(), "endpoints": ["192.0.2.1:51820"]}},
    {"wg": {**MESH.to_wire(), "endpoints": [f"192.0.2.{i}" for i in range(MAX_ADDRS + 1)]}},
])
def test_malformed_record(changes):
    assert reason(sealed(record_body(**changes))) == "malformed"


def test_largest_seq_and_most_addrs():
    addrs = [f"/ip4/192.0.2.{i}/tcp/4001" for i in range(MAX_ADDRS)]
    rec = decode(sealed(record_body(seq=MAX_SEQ - 1, addrs=addrs)))
    assert rec.seq == MAX_SEQ - 1 and len(rec.addrs) == MAX_ADDRS


@pytest.mark.parametrize("value", [MAX_SEQ, 2**64 - 2, 2**64 - 1])
def test_seqs_and_incarnations_stop_below_2_63(value):
    """Anything a node adds one to must stay encodable: 2^64 - 1 + 1 crashed msgpack (issue 11)."""
    assert reason(sealed(record_body(seq=value))) == "malformed"
    assert reason(sealed(rumor_body(inc=value))) == "malformed"


@pytest.mark.parametrize("changes", [
    {"about": ...},
    {"about": peer_str(OTHER_PEER)},
    {"about": b"\x00" * 38},
    {"inc": ...},
    {"inc": -1},
    {"inc": "42"},
    {"inc": False},
])
def test_malformed_rumor(changes):
    assert reason(sealed(rumor_body(**changes))) == "malformed"


@pytest.mark.parametrize("blob", [b"", b"\xc1", b"\x93\x01\x02\x03", record()[:-3]])
def test_not_a_signed_message(blob):
    assert reason(blob) == "malformed"


def test_a_verifier_for_another_swarm_rejects_ours():
    theirs = Verifier(swarm_id(bytes(STRANGER.verify_key)), bytes(STRANGER.verify_key))
    with pytest.raises(Invalid) as err:
        theirs.decode(record(), NOW)
    assert err.value.reason == "swarm"


def test_job_slots_and_rtts_travel_in_the_record():
    from swarmd.gossip.wire import JobSlots

    slots = JobSlots(slots=4, free=3, gpus_free=2, ranks=1)
    rec = decode(record(jobs=slots, rtts={peer_str(OTHER_PEER): 12.5}))
    assert rec.jobs == slots and rec.rtts == {peer_str(OTHER_PEER): 12.5}
    old = decode(sealed(record_body()))  # a node from before jobs: neither field
    assert old.jobs is None and old.rtts == {}


def test_a_records_rtts_take_10_bytes_an_entry_and_an_older_daemons_list_still_reads():
    from swarmd.gossip.rtts import Rtts, rtt_tag, tag_index

    other, me = peer_str(OTHER_PEER), peer_str(PEER)
    rec = decode(record(rtts={other: 12.34, me: 99_999.0}))
    assert rec.rtts[other] == 12.3 and rec.rtts.get(me) == 6553.5, "kept to 0.1 ms, at most 6,553.5 ms"
    stranger = peer_str(peer_from_key(bytes(STRANGER.verify_key)))
    assert stranger not in rec.rtts and rec.rtts.get(stranger) is None
    assert rec.rtts.named(tag_index([other])) == {other: 12.3}, "listed only for the members the reader knows"
    assert len(record(rtts={other: 1.0, me: 2.0})) - len(record()) == 4 + 2 + 2 * 10  # "rtt", bin header, 2 entries
    assert decode(record(rtts={other: float("nan"), me: float("inf")})).rtts == {}, "a broken reading left out"
    older = decode(sealed(record_body(rtts=[[OTHER_PEER, 7.5]])))
    assert older.rtts == {other: 7.5} and older.rtts == Rtts({rtt_tag(other): 7.5})


@pytest.mark.parametrize("value, detail", [
    ("12", "at most 16 entries of 10 bytes"),
    (b"\x00" * 15, "at most 16 entries of 10 bytes"),
    (b"\x00" * 170, "at most 16 entries of 10 bytes"),
    (b"\x01" * 8 + b"\x00\x05" + b"\x01" * 8 + b"\x00\x06", "a member listed twice"),
])
def test_bad_rtts_are_refused_naming_the_field(value, detail):
    with pytest.raises(Invalid, match=detail):
        decode(sealed(record_body(rtt=value)))


@pytest.mark.parametrize("field, value, detail", [
    ("jobs", {"slots": 2, "free": 3, "gpus_free": 0, "ranks": 0}, "more slots free than there are"),
    ("jobs", {"slots": 2, "free": True, "gpus_free": 0, "ranks": 0}, "record.jobs.free"),
    ("jobs", [], "record.jobs: expected a map"),
    ("rtts", [[OTHER_PEER, -1]], "0-60000 ms"),
    ("rtts", [[OTHER_PEER, True]], "0-60000 ms"),
    ("rtts", [[b"not a peer id", 5.0]], "not an Ed25519 libp2p id"),
    ("rtts", [[OTHER_PEER, 1.0]] * 17, "at most 16"),
    ("rtts", {"x": 1}, "a list of at most 16"),
])
def test_bad_job_slots_and_rtts_are_refused_naming_the_field(field, value, detail):
    with pytest.raises(Invalid, match=detail):
        decode(sealed(record_body(**{field: value})))


# --- overlay and underlay addresses (review findings 11 and 12) ---

def wg_record(cert=CERT, **changes):
    return sealed(record_body(wg={**MESH.to_wire(), **changes}, cert=cert.blob))


def test_a_record_claiming_another_members_ula_is_refused():
    victim = str(ula(SWARM, peer_str(OTHER_PEER).encode()))
    assert reason(wg_record(addr6=victim)) == "addr_mismatch"
    assert reason(wg_record(addr6="fd12:3456:789a::1")) == "addr_mismatch"
    assert decode(wg_record(addr6=None)).wg.addr6 is None  # no IPv6 route asked for: allowed
    assert decode(wg_record()).wg.addr6 == str(ula(SWARM, peer_str(PEER).encode()))


@pytest.mark.parametrize("ip", ["127.0.0.1", "127.8.9.10", "::1", "169.254.169.254", "fe80::1", "224.0.0.1",
                                "ff02::1", "0.0.0.0", "0.1.2.3", "::", "255.255.255.255", "240.0.0.1",
                                "::ffff:127.0.0.1", "::ffff:169.254.169.254", "10.211.0.7",
                                str(ula(SWARM, b"someone"))])
def test_endpoints_that_are_not_a_remote_host_are_refused(ip):
    assert reason(wg_record(endpoints=[ip])) == "bad_address"
    assert reason(sealed(record_body(addrs=[f"/ip{6 if ':' in ip else 4}/{ip}/tcp/4001"]))) == "bad_address"


@pytest.mark.parametrize("ip", ["10.200.0.5", "192.168.1.2", "172.16.0.1", "100.64.0.1", "192.0.2.1",
                                "2001:db8::1", "fd99::1"])
def test_private_and_public_underlay_addresses_are_allowed(ip):
    assert decode(wg_record(endpoints=[ip])).wg.endpoints == (ip,)
    addr = f"/ip{6 if ':' in ip else 4}/{ip}/tcp/4001"
    assert decode(sealed(record_body(addrs=[addr]))).addrs == (addr,)


# "²" and "٤٠٠١" pass str.isdigit; int() refuses the first (a ValueError, not a refusal)
# and reads the second as 4001
@pytest.mark.parametrize("addr", ["/ip4/192.0.2.1/tcp/0", "/ip4/192.0.2.1/tcp/65536", "/ip4/192.0.2.1/udp/x/quic",
                                  "/ip4/192.0.2.1/tcp/\u00b2", "/ip4/192.0.2.1/tcp/\u0664\u0660\u0660\u0661",
                                  "/ip4/192.0.2.1/tcp/004001"])
def test_record_addrs_with_a_port_outside_1_65535_are_refused(addr):
    assert reason(sealed(record_body(addrs=[addr]))) == "bad_address"


def test_a_record_address_with_an_ipv6_zone_is_refused():
    """A zone names an interface of the member's own host: no address anyone else can use."""
    assert reason(sealed(record_body(addrs=["/ip6/2001:db8::1%eth0/tcp/4001"]))) == "malformed"


@pytest.mark.parametrize("addr", ["ip4/192.0.2.1/tcp/1", "/ip4/192.0.2.300/tcp/1", "/ip6/zz/tcp/1", "/"])
def test_unreadable_record_addrs_are_malformed(addr):
    assert reason(sealed(record_body(addrs=[addr]))) == "malformed"


def test_loopback_is_allowed_only_to_a_node_that_is_itself_on_loopback():
    blob = sealed(record_body(addrs=["/ip4/127.0.0.1/tcp/4001"], wg={**MESH.to_wire(), "endpoints": ["127.0.0.1"]}))
    assert reason(blob) == "bad_address"
    assert Verifier(SWARM, OWNER_PUBLIC, local_addrs=["/ip4/127.0.0.1/tcp/4001"]).decode(blob, NOW).addrs == ("/ip4/127.0.0.1/tcp/4001",)
    assert only_loopback(["/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/4001"])
    assert not only_loopback(["/ip4/127.0.0.1/tcp/4001", "/ip4/10.200.0.2/tcp/4001"])
    assert not only_loopback(["/dns4/localhost/tcp/4001"]) and not only_loopback([])


def test_a_legacy_members_ipv4_overlay_address_must_be_a_host_of_the_overlay():
    for addr4 in ("192.168.1.1", "169.254.169.254", "10.211.0.0", "10.211.255.255"):
        assert reason(wg_record(addr4=addr4)) == "bad_address"
    assert decode(wg_record(addr4="10.211.0.1")).wg.addr4 == "10.211.0.1"
    other = Verifier(SWARM, OWNER_PUBLIC, network="10.99.0.0/24")
    assert other.decode(wg_record(addr4="10.99.0.9", endpoints=["192.0.2.1"]), NOW).wg.addr4 == "10.99.0.9"
    with pytest.raises(Invalid, match="bad_address"):
        other.decode(wg_record(), NOW)


def test_an_address_the_owner_signed_is_taken_even_outside_our_overlay():
    # the owner allocated it from its own network (mesh.py warns that the configurations differ)
    cert = issue_cert(signer(OWNER), SWARM, PEER, now=NOW - 86400, ttl=365 * 86400.0, addr4="10.99.0.9")
    assert decode(wg_record(cert, addr4="10.99.0.9")).wg.addr4 == "10.99.0.9"


# --- routing fields: coord, relay, via (issue 16) ---

THIRD_PEER = peer_from_key(bytes(SigningKey(b"\x03" * 32).verify_key))


def coordinate():
    from swarmd.vivaldi.coordinates import Coordinate

    return Coordinate(vec=(0.01, -0.02, 0.0, 0.003, 0.0, 0.0, 0.0, 0.0), error=0.4, adjustment=-0.001, height=0.002)


def test_coordinate_relay_flag_and_via_travel_in_the_record():
    via = {peer_str(OTHER_PEER): peer_str(THIRD_PEER), peer_str(THIRD_PEER): peer_str(OTHER_PEER)}
    rec = decode(record(coord=coordinate(), relay=True, via=via))
    assert (rec.coord, rec.relay, rec.via) == (coordinate(), True, via)
    old = decode(sealed(record_body()))  # a node from before routing: none of them
    assert (old.coord, old.relay, old.via) == (None, False, {})


@pytest.mark.parametrize("via, detail", [
    ([[PEER, THIRD_PEER]], "names the signer"),  # "my path to myself"
    ([[OTHER_PEER, PEER]], "names the signer"),  # "I relay for you": the signer as its own relay
    ([[OTHER_PEER, OTHER_PEER]], "the same peer twice"),  # peer == relay
    ([[OTHER_PEER, THIRD_PEER], [OTHER_PEER, THIRD_PEER]], "a peer twice"),
    ([[OTHER_PEER, THIRD_PEER], [OTHER_PEER, PEER]], "a peer twice|names the signer"),
    ([[OTHER_PEER, THIRD_PEER]] * 17, "at most 16"),
    ({OTHER_PEER: THIRD_PEER}, "expected a list"),
    (b"x", "expected a list"),
    ([[peer_str(OTHER_PEER), peer_str(THIRD_PEER)]], "peer id bytes"),  # strings, not bytes
    ([[OTHER_PEER]], "peer id bytes"), ([[OTHER_PEER, THIRD_PEER, PEER]], "peer id bytes"),
    ([OTHER_PEER], "peer id bytes"), ([None], "peer id bytes"),
    ([[OTHER_PEER, b"\x00\x24\x08\x02\x12\x20" + b"k" * 32]], "not an Ed25519 libp2p id"),  # another key type
    ([[b"short", THIRD_PEER]], "not an Ed25519 libp2p id"),
])
def test_bad_via_is_refused_naming_the_field(via, detail):
    with pytest.raises(Invalid, match=detail) as err:
        decode(sealed(record_body(via=via)))
    assert err.value.reason == "malformed"


def test_via_of_sixteen_pairs_is_the_most():
    peers = [peer_from_key(bytes([n]) * 32) for n in range(100, 117)]
    rec = decode(sealed(record_body(via=[[p, THIRD_PEER] for p in peers[:16]])))
    assert len(rec.via) == 16 and set(rec.via.values()) == {peer_str(THIRD_PEER)}


@pytest.mark.parametrize("relay", [1, 0, "true", None, [], {"on": True}])
def test_relay_must_be_a_bool(relay):
    with pytest.raises(Invalid, match="record.relay") as err:
        decode(sealed(record_body(relay=relay)))
    assert err.value.reason == "malformed"


def test_relay_false_is_the_same_as_no_relay():
    assert decode(sealed(record_body(relay=False))).relay is False


@pytest.mark.parametrize("coord", [
    "0.1", {"vec": [0.0] * 8}, [0.0] * 10, [0.0] * 12,  # not a list / wrong length
    [0.0] * 8 + [0.001, float("nan"), 0.0], [float("inf")] + [0.0] * 7 + [0.001, 0.5, 0.0],
    [1e6] + [0.0] * 7 + [0.001, 0.5, 0.0],  # a component a million seconds away
    [0.0] * 8 + [-0.001, 0.5, 0.0], [0.0] * 8 + [1e9, 0.5, 0.0],  # height negative / huge
    [0.0] * 8 + [0.001, -0.1, 0.0], [0.0] * 8 + [0.001, 99.0, 0.0],  # error outside [0, 1.5]
    [0.0] * 8 + [0.001, 0.5, 1e9],  # adjustment
    [True] + [0.0] * 7 + [0.001, 0.5, 0.0], ["0"] + [0.0] * 7 + [0.001, 0.5, 0.0],
    [2**62] + [0.0] * 7 + [0.001, 0.5, 0.0],
])
def test_a_malformed_coordinate_is_refused_naming_record_coord(coord):
    with pytest.raises(Invalid, match="record.coord") as err:
        decode(sealed(record_body(coord=coord)))
    assert err.value.reason == "malformed"

import base64
import json
import os

import pytest
from nacl.signing import SigningKey

from swarmd.gossip.cert import check_cert, issue_cert, swarm_id
from swarmd.p2p.signed import peer_from_key
from swarmd.gossip.swarmstate import (LABELS_FILE, OWNER_KEY, SEQ_FILE, SWARM_FILE, SwarmStateError, change_labels,
                                      create, effective_labels, first_seq, load, next_epoch, owner_signer,
                                      save_joined)

PEER = peer_from_key(bytes(SigningKey(b"\x01" * 32).verify_key))
OTHER_PEER = peer_from_key(bytes(SigningKey(b"\x02" * 32).verify_key))
OWNER = SigningKey(b"\x0a" * 32)
OWNER_PUBLIC = bytes(OWNER.verify_key)
NOW = 1_700_000_000.0
BOOTSTRAP = ("/ip4/192.0.2.1/tcp/4001/p2p/12D3KooWK99VoVxNE7XzyBwXEzW7xhK7Gpv85r9F3V3fyKSUKPH5",)


def mode(path):
    return path.stat().st_mode & 0o777


def joined_cert(peer=PEER, now=NOW, ttl=3600.0):
    return issue_cert(lambda d: OWNER.sign(d).signature, swarm_id(OWNER_PUBLIC), peer, now=now, ttl=ttl)


def test_nothing_to_load(tmp_path):
    assert load(tmp_path, PEER) is None


def test_create_and_load(tmp_path):
    made = create(tmp_path, PEER, now=NOW)
    assert made.is_owner
    assert made.swarm == swarm_id(made.owner_public)
    assert made.cert.roles == ("owner", "member")
    assert made.bootstrap == ()
    assert mode(tmp_path / OWNER_KEY) == 0o600
    assert mode(tmp_path / SWARM_FILE) == 0o600
    loaded = load(tmp_path, PEER)
    assert loaded is not None
    assert (loaded.swarm, loaded.owner_public, loaded.cert, loaded.bootstrap) == \
        (made.swarm, made.owner_public, made.cert, made.bootstrap)
    assert loaded.is_owner and bytes(loaded.owner_key) == bytes(made.owner_key)


def test_load_a_certificate_issued_now(tmp_path):
    # what a restart sees: a certificate issued at the real time (not at a test's fixed `now`)
    create(tmp_path, PEER)
    assert load(tmp_path, PEER).is_owner


def test_owner_signer_issues_certificates_the_swarm_accepts(tmp_path):
    m = create(tmp_path, PEER, now=NOW)
    cert = issue_cert(owner_signer(m), m.swarm, OTHER_PEER, now=NOW)
    assert check_cert(cert.blob, owner_public=m.owner_public, swarm=m.swarm, peer=OTHER_PEER, now=NOW).peer == \
        cert.peer


def test_create_twice_is_refused(tmp_path):
    first = create(tmp_path, PEER, now=NOW)
    with pytest.raises(SwarmStateError, match="already in a swarm"):
        create(tmp_path, PEER, now=NOW)
    assert load(tmp_path, PEER).swarm == first.swarm


def test_save_joined_and_load(tmp_path):
    cert = joined_cert()
    saved = save_joined(tmp_path, OWNER_PUBLIC, cert, BOOTSTRAP)
    assert not saved.is_owner
    assert not (tmp_path / OWNER_KEY).exists()
    loaded = load(tmp_path, PEER)
    assert loaded == saved
    assert loaded.bootstrap == BOOTSTRAP
    with pytest.raises(SwarmStateError, match="already in a swarm"):
        save_joined(tmp_path, OWNER_PUBLIC, cert, ())


def test_an_expired_certificate_still_loads(tmp_path):
    # the caller judges expiry at run time and can say so; the files are not damaged
    save_joined(tmp_path, OWNER_PUBLIC, joined_cert(now=1000.0, ttl=1.0), ())
    assert load(tmp_path, PEER).cert.expires == 1001.0


def test_certificate_of_another_peer(tmp_path):
    save_joined(tmp_path, OWNER_PUBLIC, joined_cert(), ())
    with pytest.raises(SwarmStateError) as err:
        load(tmp_path, OTHER_PEER)
    assert str(tmp_path / SWARM_FILE) in str(err.value)
    assert "certificate of another peer" in str(err.value)


def _good_swarm_json():
    return {"swarm": swarm_id(OWNER_PUBLIC), "owner_public": base64.b64encode(OWNER_PUBLIC).decode(),
            "cert": base64.b64encode(joined_cert().blob).decode(), "bootstrap": []}


@pytest.mark.parametrize("content", [
    b"",
    b"{",
    b"\xff\xfe not utf-8",
    b"[]",
    b"null",
    b"{}",
    json.dumps({**_good_swarm_json(), "owner_public": "!!not base64!!"}).encode(),
    json.dumps({**_good_swarm_json(), "cert": 5}).encode(),
    json.dumps({**_good_swarm_json(), "bootstrap": 5}).encode(),
    json.dumps({**_good_swarm_json(), "cert": base64.b64encode(b"garbage").decode()}).encode(),
    json.dumps({**_good_swarm_json(), "owner_public": base64.b64encode(b"\x00" * 32).decode()}).encode(),
])
def test_damaged_swarm_json_names_the_file(tmp_path, content):
    (tmp_path / SWARM_FILE).write_bytes(content)
    with pytest.raises(SwarmStateError) as err:
        load(tmp_path, PEER)
    assert str(tmp_path / SWARM_FILE) in str(err.value)
    assert "move it away and join again" in str(err.value)


def test_owner_key_readable_by_others(tmp_path):
    create(tmp_path, PEER, now=NOW)
    (tmp_path / OWNER_KEY).chmod(0o640)
    with pytest.raises(SwarmStateError) as err:
        load(tmp_path, PEER)
    assert f"chmod 600 {tmp_path / OWNER_KEY}" in str(err.value)


def test_an_owner_key_that_is_no_regular_file_of_ours_is_refused_at_start_not_read(tmp_path):
    """The three private keys are read alike (keyfile.py): a FIFO left as the owner key was
    read, and blocked the daemon's start for good; another uid's file was used."""
    create(tmp_path, PEER, now=NOW)
    key = tmp_path / OWNER_KEY
    seed = key.read_bytes()
    key.unlink()
    os.mkfifo(key, 0o600)
    with pytest.raises(SwarmStateError, match=f"owner key {key} is not a regular file"):
        load(tmp_path, PEER)
    key.unlink()
    key.write_bytes(seed)
    key.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(key, 65534, 65534)
        with pytest.raises(SwarmStateError, match=f"owner key {key} belongs to uid 65534"):
            load(tmp_path, PEER)
        os.chown(key, 0, 0)
    assert load(tmp_path, PEER).owner_key is not None


def test_owner_key_of_another_swarm(tmp_path):
    save_joined(tmp_path, OWNER_PUBLIC, joined_cert(), ())
    key = tmp_path / OWNER_KEY
    key.write_bytes(bytes(SigningKey(b"\x0b" * 32)))
    key.chmod(0o600)
    with pytest.raises(SwarmStateError, match=f"owner key {key} does not belong to swarm"):
        load(tmp_path, PEER)


@pytest.mark.parametrize("content", [b"", b"short", bytes(OWNER) + b"\x00"], ids=["empty", "short", "long"])
def test_damaged_owner_key_names_the_file(tmp_path, content):
    save_joined(tmp_path, OWNER_PUBLIC, joined_cert(), ())
    key = tmp_path / OWNER_KEY
    key.write_bytes(content)
    key.chmod(0o600)
    with pytest.raises(SwarmStateError) as err:
        load(tmp_path, PEER)
    assert str(key) in str(err.value)


def test_epochs_grow_across_restarts(tmp_path):
    epochs = [next_epoch(tmp_path) for _ in range(3)]
    assert epochs == [1, 2, 3]
    assert mode(tmp_path / SEQ_FILE) == 0o600
    assert (tmp_path / SEQ_FILE).read_text() == "3\n"


def test_first_seq_after_a_restart_beats_every_seq_before_it(tmp_path):
    before = first_seq(next_epoch(tmp_path))
    after = first_seq(next_epoch(tmp_path))  # a restart
    last_before = before + (1 << 32) - 1  # the most records one run can issue
    assert after > last_before


@pytest.mark.parametrize("epoch, seq", [(1, 1 << 32), (2, 2 << 32), (0x7FFF_FFFF, 0x7FFF_FFFF << 32)])
def test_first_seq(epoch, seq):
    assert first_seq(epoch) == seq


def test_seq_file_written_by_hand(tmp_path):
    (tmp_path / SEQ_FILE).write_text(" 41 \n")
    assert next_epoch(tmp_path) == 42


@pytest.mark.parametrize("content", ["", "seven", "1.5", "1\n2\n"])
def test_damaged_seq_file_names_the_file(tmp_path, content):
    (tmp_path / SEQ_FILE).write_text(content)
    with pytest.raises(SwarmStateError) as err:
        next_epoch(tmp_path)
    assert str(tmp_path / SEQ_FILE) in str(err.value)
    assert (tmp_path / SEQ_FILE).read_text() == content  # not replaced


CONFIGURED = {"zone": "eu-west", "tier": "gold"}


def test_labels_without_overlay_are_the_configured_ones(tmp_path):
    assert effective_labels(tmp_path, CONFIGURED) == CONFIGURED
    assert not (tmp_path / LABELS_FILE).exists()


@pytest.mark.parametrize("changes, labels", [
    ([({"gpu": "a100"}, [])], {"zone": "eu-west", "tier": "gold", "gpu": "a100"}),
    ([({"zone": "us-east"}, [])], {"zone": "us-east", "tier": "gold"}),  # overrides the configured value
    ([({}, ["tier"])], {"zone": "eu-west"}),  # removes a configured label
    ([({}, ["nonexistent"])], CONFIGURED),
    ([({"gpu": "a100"}, []), ({}, ["gpu"])], CONFIGURED),
    ([({}, ["tier"]), ({"tier": "silver"}, [])], {"zone": "eu-west", "tier": "silver"}),  # set after remove
    ([({}, ["tier"]), ({}, ["tier"])], {"zone": "eu-west"}),
    ([({"a": "1", "b": "2"}, ["zone"]), ({"a": "3"}, ["b"])], {"tier": "gold", "a": "3"}),
])
def test_label_overlay(tmp_path, changes, labels):
    for set_, remove in changes:
        change_labels(tmp_path, set_, remove)
    assert effective_labels(tmp_path, CONFIGURED) == labels
    assert mode(tmp_path / LABELS_FILE) == 0o600


def test_label_removal_outlives_a_config_change(tmp_path):
    change_labels(tmp_path, {}, ["tier"])
    # the operator removed "tier" at run time; a later config still setting it does not bring it back
    assert effective_labels(tmp_path, {"tier": "platinum", "rack": "r1"}) == {"rack": "r1"}


def test_overlay_file_is_readable_json(tmp_path):
    change_labels(tmp_path, {"gpu": "a100"}, ["tier"])
    assert json.loads((tmp_path / LABELS_FILE).read_text()) == {"set": {"gpu": "a100"}, "removed": ["tier"]}


@pytest.mark.parametrize("content", ["", "{", "[]", '{"set": []}', '{"set": "gpu=a100"}', '{"removed": 5}'])
def test_damaged_labels_file_names_the_file(tmp_path, content):
    (tmp_path / LABELS_FILE).write_text(content)
    for call in (lambda: effective_labels(tmp_path, CONFIGURED), lambda: change_labels(tmp_path, {"a": "b"}, [])):
        with pytest.raises(SwarmStateError) as err:
            call()
        assert str(tmp_path / LABELS_FILE) in str(err.value)
    assert (tmp_path / LABELS_FILE).read_text() == content


def test_revocations_kept_on_disk_and_checked_again(tmp_path):
    from swarmd.gossip.revocation import make_revocation
    from swarmd.p2p.signed import peer_str
    from swarmd.gossip.swarmstate import REVOKED_FILE, load_revocations, save_revocations

    m = create(tmp_path, PEER, now=NOW)
    assert load_revocations(tmp_path, m, NOW) == []
    good = make_revocation(owner_signer(m), m.swarm, peer_str(OTHER_PEER), now=NOW, reason="left the company")
    forged = make_revocation(lambda d: SigningKey(b"\x0c" * 32).sign(d).signature, m.swarm, peer_str(PEER), now=NOW)
    save_revocations(tmp_path, [good, forged])
    assert mode(tmp_path / REVOKED_FILE) == 0o600
    assert load_revocations(tmp_path, m, NOW + 1) == [good]  # the file is not trusted more than the network
    (tmp_path / REVOKED_FILE).write_text("{")
    with pytest.raises(SwarmStateError, match="revoked.json is damaged"):
        load_revocations(tmp_path, m, NOW)


def test_renewed_certificate_replaces_the_old(tmp_path):
    from swarmd.gossip.swarmstate import save_cert

    save_joined(tmp_path, OWNER_PUBLIC, joined_cert(), BOOTSTRAP)
    m = load(tmp_path, PEER)
    renewed = issue_cert(lambda d: OWNER.sign(d).signature, m.swarm, PEER, now=NOW + 100, ttl=7200.0,
                         addr4="10.211.0.7")
    saved = save_cert(tmp_path, m, renewed)
    assert saved.cert == renewed and saved.bootstrap == BOOTSTRAP
    again = load(tmp_path, PEER)
    assert again.cert.expires == NOW + 7300.0 and again.cert.addr4 == "10.211.0.7"


def test_owner_registries_round_trip_and_damage(tmp_path):
    from swarmd.gossip.swarmstate import INVITES_FILE, load_invites, load_members, save_invites

    inv = load_invites(tmp_path)
    inv.add("abcd", uses=2, expires=NOW + 60, now=NOW)
    save_invites(tmp_path, inv)
    assert mode(tmp_path / INVITES_FILE) == 0o600
    assert load_invites(tmp_path).items["abcd"].uses == 2
    (tmp_path / INVITES_FILE).write_text('{"abcd": {"uses": "x"}}')
    with pytest.raises(SwarmStateError, match="invites.json is damaged"):
        load_invites(tmp_path)
    assert load_members(tmp_path).items == {}


def test_the_owners_own_certificate_names_an_address_joins_never_get(tmp_path):
    from ipaddress import IPv4Address, IPv4Network

    from swarmd.p2p.signed import peer_str
    from swarmd.gossip.swarmstate import MEMBERS_FILE, certify, load_members

    network = IPv4Network("10.99.0.0/29")  # 6 hosts: the owner and five members fill it
    m = create(tmp_path, PEER, now=NOW, network=network)
    assert m.cert.addr4 is not None and IPv4Address(m.cert.addr4) in network
    assert load(tmp_path, PEER).cert.addr4 == m.cert.addr4
    assert load_members(tmp_path).items[peer_str(PEER)].addr4 == m.cert.addr4
    assert mode(tmp_path / MEMBERS_FILE) == 0o600
    given = {m.cert.addr4}
    for n in range(5):
        peer = peer_from_key(bytes(SigningKey(bytes([0x30 + n]) * 32).verify_key))
        cert = certify(tmp_path, m.owner_key, peer, now=NOW, network=network, ttl=3600.0)
        assert check_cert(cert.blob, owner_public=m.owner_public, swarm=m.swarm, peer=peer, now=NOW).addr4 == \
            cert.addr4
        given.add(cert.addr4)
    assert len(given) == 6 and all(IPv4Address(a) in network for a in given)  # never the owner's, never twice


def test_certify_keeps_a_renewals_address_and_a_peers_earlier_one(tmp_path):
    from ipaddress import IPv4Network

    from swarmd.gossip.swarmstate import certify

    m = create(tmp_path, PEER, now=NOW)
    first = certify(tmp_path, m.owner_key, OTHER_PEER, now=NOW, network=IPv4Network("10.211.0.0/16"), ttl=60.0)
    again = certify(tmp_path, m.owner_key, OTHER_PEER, now=NOW + 30, network=IPv4Network("10.211.0.0/16"),
                    ttl=60.0)
    assert again.addr4 == first.addr4 and again.expires == NOW + 90
    kept = certify(tmp_path, m.owner_key, OTHER_PEER, now=NOW + 40, network=IPv4Network("10.211.0.0/16"),
                   ttl=60.0, addr4=first.addr4, roles=("member",))
    assert kept.addr4 == first.addr4


def test_a_new_swarm_starts_a_new_registry(tmp_path):
    from swarmd.p2p.signed import peer_str
    from swarmd.gossip.swarmstate import MEMBERS_FILE, load_members

    (tmp_path / MEMBERS_FILE).write_text(json.dumps({peer_str(OTHER_PEER): {"addr4": "10.211.0.9", "expires": NOW,
                                                                           "revoked": None}}))
    create(tmp_path, PEER, now=NOW)
    assert list(load_members(tmp_path).items) == [peer_str(PEER)]  # an earlier swarm's members name nobody here


def test_the_labs_swarm_allocates_every_address_through_the_owners_registry(tmp_path):
    from ipaddress import IPv4Address, IPv4Network

    from sim.netlab.lab import _make_swarm
    from swarmd.p2p.signed import peer_str
    from swarmd.gossip.swarmstate import load_members

    keys = [SigningKey(bytes([0x40 + n]) * 32) for n in range(4)]
    peers = [peer_from_key(bytes(k.verify_key)) for k in keys]
    dirs = [tmp_path / f"h{n}" for n in range(4)]
    for d in dirs:
        d.mkdir()
    network = IPv4Network("10.98.0.0/24")
    _make_swarm(dirs, [peer_str(p) for p in peers], network=network)
    certs = [load(d, p).cert for d, p in zip(dirs, peers)]
    assert all(c.addr4 is not None and IPv4Address(c.addr4) in network for c in certs)
    assert len({c.addr4 for c in certs}) == 4
    registry = load_members(dirs[0]).items
    assert {p: r.addr4 for p, r in registry.items()} == {c.peer: c.addr4 for c in certs}


def test_a_label_with_a_control_character_left_on_disk_is_left_out_not_fatal(tmp_path):
    """An older version let `swarmctl labels set` store any text; members now refuse a record
    with a control character in a label, so the node starts without that label, not at all."""
    (tmp_path / LABELS_FILE).write_text(json.dumps(
        {"set": {"zone": "eu\u001b]52;c;aGk=\u0007", "tier": "gold"}, "removed": []}))
    assert effective_labels(tmp_path, {"region": "west"}) == {"region": "west", "tier": "gold"}

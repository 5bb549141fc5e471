import base64
import string

import msgpack
import pytest
from nacl.signing import SigningKey

from swarmd.gossip.cert import (CLOCK_SKEW, DEFAULT_CERT_TTL, DEFAULT_INVITE_TTL, MEMBER_ROLES, RENEW_WINDOW, TOKEN_PREFIX,
                                check_cert, check_ticket, read_ticket, renew_due,
                                issue_cert, make_token, parse_token, swarm_id)
from swarmd.p2p.signed import Invalid, peer_from_key, peer_str, seal

OWNER = SigningKey(b"\x0a" * 32)
OWNER_PUBLIC = bytes(OWNER.verify_key)
STRANGER = SigningKey(b"\x0b" * 32)
SWARM = swarm_id(OWNER_PUBLIC)
PEER = peer_from_key(bytes(SigningKey(b"\x01" * 32).verify_key))
OTHER_PEER = peer_from_key(bytes(SigningKey(b"\x02" * 32).verify_key))
NOW = 1_700_000_000.0
ADDRS = ["/ip4/192.0.2.1/tcp/4001/p2p/" + peer_str(PEER), "/ip6/2001:db8::1/udp/4001/quic-v1/p2p/" + peer_str(PEER)]


def owner_sign(data: bytes) -> bytes:
    return OWNER.sign(data).signature


def stranger_sign(data: bytes) -> bytes:
    return STRANGER.sign(data).signature


def check(blob, *, swarm=SWARM, peer=PEER, now=NOW + 10):
    return check_cert(blob, owner_public=OWNER_PUBLIC, swarm=swarm, peer=peer, now=now)


def test_swarm_id_is_16_hex_digits_of_the_owner_key():
    assert len(SWARM) == 16 and all(c in string.hexdigits for c in SWARM)
    assert swarm_id(OWNER_PUBLIC) == SWARM
    assert swarm_id(bytes(STRANGER.verify_key)) != SWARM


def test_issue_and_check():
    issued = issue_cert(owner_sign, SWARM, PEER, now=NOW, ttl=3600.0)
    assert (issued.swarm, issued.peer, issued.roles) == (SWARM, peer_str(PEER), MEMBER_ROLES)
    assert (issued.issued, issued.expires) == (NOW, NOW + 3600.0)
    checked = check(issued.blob)
    assert checked == issued
    assert checked.to_dict() == {"swarm": SWARM, "peer": peer_str(PEER), "roles": ["member"],
                                 "issued": NOW, "expires": NOW + 3600.0, "addr4": None}


def test_default_ttl_and_roles():
    cert = check(issue_cert(owner_sign, SWARM, PEER, now=NOW, roles=("owner", "member")).blob)
    assert cert.expires == NOW + DEFAULT_CERT_TTL
    assert cert.roles == ("owner", "member")


def test_time_bounds():
    blob = issue_cert(owner_sign, SWARM, PEER, now=NOW, ttl=100.0).blob
    assert check(blob, now=NOW + 99.9).expires == NOW + 100.0
    with pytest.raises(Invalid, match="^cert: certificate expired$"):
        check(blob, now=NOW + 100.0)  # expires is the first instant it is no longer valid


@pytest.mark.parametrize("issued_ahead, ok", [
    (0.0, True),
    (CLOCK_SKEW - 1, True),  # the owner's clock is a few minutes fast: tolerated
    (CLOCK_SKEW, True),
    (CLOCK_SKEW + 1, False),
    (86400.0, False),
])
def test_clock_skew_tolerance(issued_ahead, ok):
    blob = issue_cert(owner_sign, SWARM, PEER, now=NOW + issued_ahead, ttl=3600.0).blob
    if ok:
        assert check(blob, now=NOW).issued == NOW + issued_ahead
    else:
        with pytest.raises(Invalid, match="^cert: certificate issued in the future$"):
            check(blob, now=NOW)


def _body(**changes):
    body = {"v": 1, "k": "cert", "swarm": SWARM, "peer": PEER, "roles": ["member"], "issued": NOW,
            "expires": NOW + 3600.0}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not ...}


@pytest.mark.parametrize("blob, check_kw, detail", [
    (issue_cert(owner_sign, SWARM, PEER, now=NOW - 7200, ttl=3600.0).blob, {}, "certificate expired"),
    (issue_cert(owner_sign, "0123456789abcdef", PEER, now=NOW).blob, {}, "certificate of another swarm"),
    (issue_cert(owner_sign, SWARM, PEER, now=NOW).blob, {"swarm": "0123456789abcdef"},
     "certificate of another swarm"),
    (issue_cert(owner_sign, SWARM, OTHER_PEER, now=NOW).blob, {}, "certificate of another peer"),
    (issue_cert(owner_sign, SWARM, PEER, now=NOW).blob, {"peer": OTHER_PEER}, "certificate of another peer"),
    (issue_cert(stranger_sign, SWARM, PEER, now=NOW).blob, {}, "certificate: signature does not verify"),
    (issue_cert(stranger_sign, swarm_id(bytes(STRANGER.verify_key)), PEER, now=NOW).blob, {},
     "certificate: signature does not verify"),
    (None, {}, "certificate: expected signed bytes"),
    (b"garbage", {}, "certificate: not msgpack"),
    (make_token(owner_sign, OWNER_PUBLIC, ADDRS, now=NOW, expires_in=3600).ticket, {},
     "not a version-1 certificate"),  # an invite is not a certificate
    (seal(_body(v=2), owner_sign), {}, "not a version-1 certificate"),
    (seal(_body(v=...), owner_sign), {}, "not a version-1 certificate"),
    (seal(_body(swarm=SWARM.encode()), owner_sign), {}, "cert.swarm: expected str, got bytes"),
    (seal(_body(peer=peer_str(PEER)), owner_sign), {}, "cert.peer: expected bytes, got str"),
    (seal(_body(issued="now"), owner_sign), {}, "cert.issued: expected int/float, got str"),
    (seal(_body(expires=...), owner_sign), {}, "cert.expires: expected int/float, got NoneType"),
    (seal(_body(roles="member"), owner_sign), {}, "cert.roles: expected list, got str"),
])
def test_rejected_with_a_clear_reason(blob, check_kw, detail):
    with pytest.raises(Invalid) as err:
        check(blob, **check_kw)
    assert err.value.reason == "cert"
    assert err.value.detail.startswith(detail), err.value.detail


def test_integer_times_are_accepted():
    cert = check(seal(_body(issued=int(NOW), expires=int(NOW) + 3600), owner_sign))
    assert (cert.issued, cert.expires) == (NOW, NOW + 3600.0)


def test_token_round_trip():
    token = make_token(owner_sign, OWNER_PUBLIC, ADDRS, now=NOW, expires_in=3600.0)
    text = token.encode()
    assert text.startswith(TOKEN_PREFIX)
    assert "=" not in text and "+" not in text and "/" not in text  # pastes cleanly into a shell
    parsed = parse_token(text)
    assert parsed == token
    assert parsed.swarm == SWARM
    assert parsed.addrs == tuple(ADDRS)
    assert parsed.expires == NOW + 3600.0
    assert parse_token(f"  {text}\n") == token  # as pasted from a terminal


def test_tokens_are_distinct():
    a = make_token(owner_sign, OWNER_PUBLIC, ADDRS, now=NOW, expires_in=3600.0)
    b = make_token(owner_sign, OWNER_PUBLIC, ADDRS, now=NOW, expires_in=3600.0)
    assert a.ticket != b.ticket  # a nonce: two invites are two credentials


def test_ticket_grants_roles_and_cert_ttl():
    token = make_token(owner_sign, OWNER_PUBLIC, ADDRS, now=NOW, expires_in=3600.0, cert_ttl=86400.0)
    assert check_ticket(token.ticket, owner_public=OWNER_PUBLIC, now=NOW + 3599) == (MEMBER_ROLES, 86400.0)


def test_expired_ticket_is_rejected():
    token = make_token(owner_sign, OWNER_PUBLIC, ADDRS, now=NOW, expires_in=3600.0)
    with pytest.raises(Invalid) as err:
        check_ticket(token.ticket, owner_public=OWNER_PUBLIC, now=NOW + 3600.0)
    assert err.value.reason == "ticket"
    assert "the invite has expired" in err.value.detail


def _ticket(**changes):
    body = {"v": 1, "k": "invite", "swarm": SWARM, "roles": ["member"], "expires": NOW + 3600,
            "cert_ttl": 86400.0, "nonce": b"\x00" * 12}
    body.update(changes)
    return seal({k: v for k, v in body.items() if v is not ...}, owner_sign)


@pytest.mark.parametrize("ticket, detail", [
    (make_token(stranger_sign, OWNER_PUBLIC, ADDRS, now=NOW, expires_in=3600.0).ticket,
     "invite: signature does not verify"),
    (make_token(stranger_sign, bytes(STRANGER.verify_key), ADDRS, now=NOW, expires_in=3600.0).ticket,
     "invite: signature does not verify"),
    (issue_cert(owner_sign, SWARM, PEER, now=NOW).blob, "not an invite to this swarm"),
    (_ticket(swarm="0123456789abcdef"), "not an invite to this swarm"),
    (_ticket(expires="tomorrow"), "invite.expires: expected int/float, got str"),
    (_ticket(cert_ttl=...), "invite.cert_ttl: expected int/float, got NoneType"),
    (_ticket(roles=...), "invite.roles: expected list, got NoneType"),
    (b"\xc1", "invite: not msgpack"),
    (None, "invite: expected signed bytes"),
])
def test_bad_tickets(ticket, detail):
    with pytest.raises(Invalid) as err:
        check_ticket(ticket, owner_public=OWNER_PUBLIC, now=NOW)
    assert err.value.reason == "ticket"
    assert err.value.detail.startswith(detail), err.value.detail


TOKEN = make_token(owner_sign, OWNER_PUBLIC, ADDRS, now=NOW, expires_in=3600.0).encode()


@pytest.mark.parametrize("text", [
    "",
    "hello",
    TOKEN[len(TOKEN_PREFIX):],  # the prefix lost in copying
    "swarmd2." + TOKEN[len(TOKEN_PREFIX):],
])
def test_not_a_token(text):
    with pytest.raises(ValueError, match="^not a swarmd invite token"):
        parse_token(text)


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 40, len(TOKEN) - len(TOKEN_PREFIX) - 1,
                                 len(TOKEN) - len(TOKEN_PREFIX)])
def test_truncated_token(cut):
    with pytest.raises(ValueError, match=r"^the invite token is damaged \(was it cut short when copied\?\)$"):
        parse_token(TOKEN[:-cut])


def _encode(data) -> str:
    return TOKEN_PREFIX + base64.urlsafe_b64encode(msgpack.packb(data, use_bin_type=True)).decode().rstrip("=")


GOOD = {"v": 1, "owner": OWNER_PUBLIC, "ticket": parse_token(TOKEN).ticket, "addrs": ADDRS}


@pytest.mark.parametrize("data", [
    {**GOOD, "v": 2},
    {k: v for k, v in GOOD.items() if k != "v"},
    {k: v for k, v in GOOD.items() if k != "addrs"},
    {**GOOD, "owner": OWNER_PUBLIC[:31]},
    {**GOOD, "owner": OWNER_PUBLIC.hex()},
    {**GOOD, "ticket": None},
    {**GOOD, "addrs": [1, 2]},
    {**GOOD, "addrs": ADDRS[0]},  # one address, not a list of them
    {**GOOD, "addrs": None},
    [GOOD["owner"], GOOD["ticket"], GOOD["addrs"]],
])
def test_damaged_token(data):
    with pytest.raises(ValueError, match="^the invite token is damaged"):
        parse_token(_encode(data))


def test_token_of_another_owner_key():
    with pytest.raises(ValueError, match="^the invite token's signature does not verify$"):
        parse_token(_encode({**GOOD, "owner": bytes(STRANGER.verify_key)}))


@pytest.mark.parametrize("extra", ["A", "AA", "AAAA", "AAAAA"])
def test_token_with_extra_characters(extra):
    with pytest.raises(ValueError, match="^the invite token is damaged"):
        parse_token(TOKEN + extra)


def test_any_one_changed_character_gives_a_value_error_or_the_same_owner():
    # a typo anywhere must be reported as such, never crash, never yield another owner's token
    alphabet = string.ascii_letters + string.digits + "-_"
    for i in range(len(TOKEN_PREFIX), len(TOKEN)):
        c = alphabet[(alphabet.index(TOKEN[i]) + 1) % len(alphabet)]
        try:
            token = parse_token(TOKEN[:i] + c + TOKEN[i + 1:])
        except ValueError:
            continue
        assert token.owner_public == OWNER_PUBLIC
        assert check_ticket(token.ticket, owner_public=OWNER_PUBLIC, now=NOW)


# --- overlay addresses, renewal, single-use tickets ------------------------------------------

def test_certificate_carries_the_owners_address():
    cert = check(issue_cert(owner_sign, SWARM, PEER, now=NOW, ttl=3600.0, addr4="10.211.4.5").blob)
    assert cert.addr4 == "10.211.4.5" and cert.to_dict()["addr4"] == "10.211.4.5"
    assert check(issue_cert(owner_sign, SWARM, PEER, now=NOW, ttl=3600.0).blob).addr4 is None


@pytest.mark.parametrize("addr4, detail", [
    (1, "cert.addr4: expected str, got int"),
    ("10.211.4.300", "cert.addr4: '10.211.4.300' is not an IPv4 address"),
    ("fd00::1", "cert.addr4: 'fd00::1' is not an IPv4 address"),
])
def test_bad_certificate_address(addr4, detail):
    with pytest.raises(Invalid) as err:
        check(seal(_body(addr4=addr4), owner_sign))
    assert err.value.reason == "cert" and err.value.detail == detail


@pytest.mark.parametrize("ttl, due_before_expiry", [
    (365 * 86400.0, RENEW_WINDOW),  # a year: 30 days ahead (less than a third)
    (30 * 86400.0, 10 * 86400.0),  # a month: a third of it
    (60.0, 20.0),
])
def test_renew_due(ttl, due_before_expiry):
    cert = issue_cert(owner_sign, SWARM, PEER, now=NOW, ttl=ttl, addr4="10.211.0.5")
    assert renew_due(cert) == pytest.approx(NOW + ttl - due_before_expiry)


def test_a_certificate_without_an_address_is_due_for_renewal_at_once():
    # until its holder has a certificate address, its address is a derived claim a ground key can take
    assert renew_due(issue_cert(owner_sign, SWARM, PEER, now=NOW, ttl=365 * 86400.0)) == NOW


def test_ticket_names_its_nonce_and_uses():
    token = make_token(owner_sign, OWNER_PUBLIC, ADDRS, now=NOW, expires_in=DEFAULT_INVITE_TTL, uses=3)
    t = read_ticket(token.ticket, owner_public=OWNER_PUBLIC, now=NOW)
    assert (t.uses, t.expires, len(t.nonce)) == (3, NOW + 86400.0, 24)
    assert read_ticket(make_token(owner_sign, OWNER_PUBLIC, ADDRS, now=NOW, expires_in=60).ticket,
                       owner_public=OWNER_PUBLIC, now=NOW).uses == 1


@pytest.mark.parametrize("ticket, detail", [
    (_ticket(uses=0), "invite.uses: expected 1-10000"),
    (_ticket(uses=True), "invite.uses: expected 1-10000"),
    (_ticket(uses=10**9), "invite.uses: expected 1-10000"),
    (_ticket(nonce=b""), "invite.nonce: expected 8-32 bytes"),
    (_ticket(nonce=...), "invite.nonce: expected bytes, got NoneType"),
    (_ticket(roles=[1]), "invite.roles: expected at most 8 role names"),
    (_ticket(cert_ttl=float("inf")), "invite: times out of range"),
])
def test_bad_ticket_fields(ticket, detail):
    with pytest.raises(Invalid) as err:
        read_ticket(ticket, owner_public=OWNER_PUBLIC, now=NOW)
    assert err.value.reason == "ticket" and err.value.detail == detail


def test_an_overlong_token_is_refused_before_it_is_decoded():
    with pytest.raises(ValueError, match="characters long"):
        parse_token("swarmd1." + "kJCQ" * 10_000)

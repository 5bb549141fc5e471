"""WireGuard key file: creation, checks at load, rotation that survives a crash, text forms."""

from __future__ import annotations

import base64
import os
import random
import shutil
import subprocess

import pytest
from nacl.public import PrivateKey

from swarmd.wg import keys
from swarmd.wg.keys import KEY_FILE, OLD_KEY_FILE, KeyPair, WgKeyError, load_or_create, public_from_b64, rotate


def _write_raw(path, content: bytes, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.write(fd, content)
    os.close(fd)


def test_created_once_as_wg_genkey_prints_it_with_owner_only_mode(tmp_path):
    state = tmp_path / "state"
    pair = load_or_create(state)
    path = state / KEY_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.read_text() == pair.private_b64 + "\n"
    assert len(pair.private_b64) == 44
    assert base64.b64decode(pair.private_b64) == pair.private
    assert pair.public == bytes(PrivateKey(pair.private).public_key)
    assert load_or_create(state) == pair


def test_new_keys_are_clamped_and_distinct(tmp_path):
    a, b = load_or_create(tmp_path / "a"), load_or_create(tmp_path / "b")
    assert a.private != b.private and a.public != b.public
    for pair in (a, b):
        assert pair.private[0] & 7 == 0
        assert pair.private[31] & 0xC0 == 0x40


def test_private_key_stays_out_of_repr():
    pair = KeyPair.generate()
    assert "private" not in repr(pair)
    assert repr(pair.private) not in repr(pair)
    assert repr(pair.public) in repr(pair)


@pytest.mark.skipif(shutil.which("wg") is None, reason="wireguard-tools not installed")
def test_public_key_agrees_with_wg_pubkey(tmp_path):
    pair = load_or_create(tmp_path)
    out = subprocess.run(["wg", "pubkey"], input=pair.private_b64 + "\n", capture_output=True, text=True,
                         check=True, timeout=10)
    assert out.stdout.strip() == pair.public_b64


@pytest.mark.skipif(shutil.which("wg") is None, reason="wireguard-tools not installed")
def test_a_key_from_wg_genkey_loads(tmp_path):
    genkey = subprocess.run(["wg", "genkey"], capture_output=True, text=True, check=True, timeout=10).stdout
    _write_raw(tmp_path / KEY_FILE, genkey.encode())
    pubkey = subprocess.run(["wg", "pubkey"], input=genkey, capture_output=True, text=True, check=True,
                            timeout=10).stdout
    assert load_or_create(tmp_path).public_b64 == pubkey.strip()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_key_readable_by_others_is_refused_with_the_fix(tmp_path, mode):
    load_or_create(tmp_path)
    path = tmp_path / KEY_FILE
    path.chmod(mode)
    with pytest.raises(WgKeyError) as err:
        load_or_create(tmp_path)
    assert str(path) in str(err.value)
    assert f"chmod 600 {path}" in str(err.value)
    assert f"{mode:04o}" in str(err.value)


CORRUPT = [
    ("empty", b""),
    ("not base64", b"not a key at all!\n"),
    ("31 bytes", base64.b64encode(bytes(31)) + b"\n"),
    ("33 bytes", base64.b64encode(bytes(33)) + b"\n"),
    ("urlsafe alphabet", base64.urlsafe_b64encode(bytes([0xFB] * 32)) + b"\n"),
    ("not ASCII", b"\xff\xfe" * 22),
]


@pytest.mark.parametrize("content", [c for _, c in CORRUPT], ids=[n for n, _ in CORRUPT])
def test_corrupt_key_is_refused_not_replaced(tmp_path, content):
    path = tmp_path / KEY_FILE
    _write_raw(path, content)
    with pytest.raises(WgKeyError, match="is corrupt .*move it away") as err:
        load_or_create(tmp_path)
    assert str(path) in str(err.value)
    assert path.read_bytes() == content


def test_a_directory_in_place_of_the_key_is_refused(tmp_path):
    (tmp_path / KEY_FILE).mkdir()
    with pytest.raises(WgKeyError, match="not a regular file: move it away"):
        load_or_create(tmp_path)


def test_rotate_keeps_the_old_key_beside_the_new(tmp_path):
    first = load_or_create(tmp_path)
    old, new = rotate(tmp_path)
    assert old == first and new != first
    assert load_or_create(tmp_path) == new
    assert (tmp_path / OLD_KEY_FILE).read_text() == first.private_b64 + "\n"
    for name in (KEY_FILE, OLD_KEY_FILE):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600
    old2, newer = rotate(tmp_path)
    assert old2 == new
    assert (tmp_path / OLD_KEY_FILE).read_text() == new.private_b64 + "\n"
    assert load_or_create(tmp_path) == newer


def test_a_crash_mid_rotation_leaves_the_old_key_in_both_files(tmp_path, monkeypatch):
    first = load_or_create(tmp_path)
    real = keys.write_atomically
    writes = []

    def crash_on_second(path, data, *, mode):
        writes.append(path.name)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        real(path, data, mode=mode)

    monkeypatch.setattr(keys, "write_atomically", crash_on_second)
    with pytest.raises(WgKeyError, match=f"{KEY_FILE}: cannot write: No space left"):
        rotate(tmp_path)
    assert writes == [OLD_KEY_FILE, KEY_FILE]  # the old key is safe before the live file changes
    monkeypatch.setattr(keys, "write_atomically", real)
    assert load_or_create(tmp_path) == first
    assert (tmp_path / OLD_KEY_FILE).read_text() == first.private_b64 + "\n"


def test_text_forms():
    pair = KeyPair.from_private(bytes(range(32)))
    assert keys.to_hex(pair.public) == pair.public.hex() == pair.public.hex().lower()
    assert len(keys.to_hex(pair.public)) == 64
    assert keys.b64(pair.public) == pair.public_b64
    assert public_from_b64(pair.public_b64) == pair.public
    assert public_from_b64(f"  {pair.public_b64}\n") == pair.public


BAD_PUBLIC = [
    ("", "32 bytes .*got 0 bytes"),
    (base64.b64encode(bytes(16)).decode(), "32 bytes .*got 16 bytes"),
    ("@" * 44, "standard base64"),
    (base64.b64encode(bytes(32)).decode()[:-1], "standard base64"),
]


@pytest.mark.parametrize("text,error", BAD_PUBLIC)
def test_public_from_b64_names_what_is_wrong(text, error):
    with pytest.raises(ValueError, match=error):
        public_from_b64(text)


def test_from_private_checks_length():
    with pytest.raises(ValueError, match="32 bytes, got 31"):
        KeyPair.from_private(bytes(31))


# --- proof of holding the key (XEdDSA) -------------------------------------------------------

PROOF_CASES = [(seed, f"message {seed}".encode()) for seed in range(24)]


@pytest.mark.parametrize("seed, message", PROOF_CASES)
def test_proof_verifies_for_random_keys(seed, message):
    rng = random.Random(seed)
    pair = keys.KeyPair.from_private(bytes(rng.getrandbits(8) for _ in range(32)))  # clamped or not
    proof = keys.prove(pair.private, message)
    assert len(proof) == keys.PROOF_LEN
    assert keys.verify_proof(pair.public, message, proof)
    assert keys.prove(pair.private, message, b"\0" * 64) == keys.prove(pair.private, message, b"\0" * 64)
    assert keys.prove(pair.private, message) != proof  # a fresh nonce each time


def _flip(data: bytes, i: int) -> bytes:
    return data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]


PAIR = keys.KeyPair.from_private(bytes(range(32)))
OTHER_PAIR = keys.KeyPair.from_private(bytes(range(1, 33)))
MESSAGE = b"swarmd wg key proof\0swarm\0peer"
PROOF = keys.prove(PAIR.private, MESSAGE)


@pytest.mark.parametrize("public, message, proof", [
    (OTHER_PAIR.public, MESSAGE, PROOF),  # the wrong key
    (PAIR.public, MESSAGE + b"!", PROOF),  # the wrong message
    (PAIR.public, MESSAGE, _flip(PROOF, 0)),  # R tampered
    (PAIR.public, MESSAGE, _flip(PROOF, 40)),  # s tampered
    (PAIR.public, MESSAGE, PROOF[:63]),  # short
    (PAIR.public, MESSAGE, keys.prove(OTHER_PAIR.private, MESSAGE)),  # someone else's proof
    (PAIR.public[:31], MESSAGE, PROOF),
    ((2**255 - 20).to_bytes(32, "little"), MESSAGE, PROOF),  # u = -1: no Edwards point
    ((2**255 - 1).to_bytes(32, "little"), MESSAGE, PROOF),  # not canonical
    (bytes(32), MESSAGE, PROOF),  # a low-order point
], ids=["wrong-key", "wrong-message", "R-tampered", "s-tampered", "short", "another-key's", "short-key", "no-point",
        "not-canonical", "low-order"])  # named: a proof has a fresh nonce, each collection its own bytes
def test_proof_refused(public, message, proof):
    assert not keys.verify_proof(public, message, proof)


def test_rotated_key_needs_a_new_proof(tmp_path):
    old, new = keys.rotate(tmp_path)
    proof = keys.prove(old.private, MESSAGE)
    assert keys.verify_proof(old.public, MESSAGE, proof) and not keys.verify_proof(new.public, MESSAGE, proof)
    assert keys.verify_proof(new.public, MESSAGE, keys.prove(new.private, MESSAGE))

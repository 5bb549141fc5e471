import os
import subprocess
import sys

import pytest

from swarmd.identity import KEY_FILE, IdentityError, load_or_create


def test_created_once_with_owner_only_mode(tmp_path):
    state = tmp_path / "state"
    first, created = load_or_create(state)
    assert created
    assert (state / KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert state.stat().st_mode & 0o777 == 0o700
    again, created = load_or_create(state)
    assert not created
    assert again.peer_id == first.peer_id
    assert str(first.peer_id).startswith("12D3KooW")  # an Ed25519 libp2p peer id


def test_signatures_verify_with_the_public_key(tmp_path):
    ident, _ = load_or_create(tmp_path)
    sig = ident.sign(b"record")
    assert ident.key_pair.public_key.verify(b"record", sig)
    assert not ident.key_pair.public_key.verify(b"other", sig)


def test_key_readable_by_others_is_refused_with_the_fix(tmp_path):
    load_or_create(tmp_path)
    (tmp_path / KEY_FILE).chmod(0o644)
    with pytest.raises(IdentityError) as err:
        load_or_create(tmp_path)
    assert f"chmod 600 {tmp_path / KEY_FILE}" in str(err.value)
    assert "0644" in str(err.value)


@pytest.mark.parametrize("content", [b"", b"garbage", b"\x08\x01\x12\x20" + b"\x00" * 10])
def test_corrupt_key_is_refused_not_replaced(tmp_path, content):
    path = tmp_path / KEY_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(IdentityError, match="is corrupt .*move it away"):
        load_or_create(tmp_path)
    assert path.read_bytes() == content


def test_daemon_refuses_to_start_on_a_bad_key(tmp_path):
    load_or_create(tmp_path / "state")
    (tmp_path / "state" / KEY_FILE).chmod(0o640)
    (tmp_path / "empty.toml").touch()
    proc = subprocess.run([sys.executable, "-m", "swarmd.main", "--config", str(tmp_path / "empty.toml"),
                           "--state-dir", str(tmp_path / "state"), "--socket", str(tmp_path / "s.sock"),
                           "--metrics-addr", "off", "--listen", "/ip4/127.0.0.1/tcp/0"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "chmod 600" in proc.stderr
    assert not (tmp_path / "s.sock").exists()


def test_identity_survives_restart(make_daemon):
    d = make_daemon()
    peer = d.call("status")["peer_id"]
    assert d.stop() == 0
    d.start()
    assert d.call("status")["peer_id"] == peer

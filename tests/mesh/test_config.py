"""How the daemon decides on its mesh from the config: off, given way, or a clear error."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from swarmd.main import main
from swarmd.mesh import driver as wg_mesh
from swarmd.wg.backend import BackendUnavailable


@dataclass
class Conf:
    mesh: str
    state_dir: Path
    mesh_interface: str = "swtest0"
    mesh_network: str = "10.211.0.0/16"
    mesh_port: int = 51820
    mesh_mtu: int = 1420


def test_off_means_no_mesh(tmp_path):
    mesh, why = wg_mesh.from_config(Conf("off", tmp_path), gossip=None)
    assert mesh is None and "off" in why


def test_auto_gives_way_without_privileges(tmp_path, monkeypatch):
    monkeypatch.setattr(wg_mesh, "can_admin_network", lambda: False)
    mesh, why = wg_mesh.from_config(Conf("auto", tmp_path), gossip=None)
    assert mesh is None and "CAP_NET_ADMIN" in why


@pytest.mark.parametrize("backend", ["kernel", "userspace"])
def test_a_forced_backend_without_privileges_is_an_error(tmp_path, monkeypatch, backend):
    monkeypatch.setattr(wg_mesh, "can_admin_network", lambda: False)
    with pytest.raises(BackendUnavailable, match=f"mesh = '{backend}' needs root or CAP_NET_ADMIN"):
        wg_mesh.from_config(Conf(backend, tmp_path), gossip=None)


@pytest.mark.skipif(Path("/sys/module/wireguard").exists(), reason="this kernel has the WireGuard module")
def test_the_daemon_exits_2_naming_the_missing_backend(tmp_path, capsys):
    (tmp_path / "empty.toml").touch()
    code = main(["--config", str(tmp_path / "empty.toml"), "--state-dir", str(tmp_path / "state"),
                 "--socket", str(tmp_path / "s.sock"), "--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-addr", "off",
                 "--mdns", "off", "--mesh", "kernel"])
    err = capsys.readouterr().err
    assert code == 2 and "'kernel'" in err and ("no WireGuard module" in err or "CAP_NET_ADMIN" in err), err


def test_bad_mesh_settings_are_config_errors(tmp_path, capsys):
    (tmp_path / "empty.toml").touch()
    for flag, value, named in (("--mesh", "tunnel", "--mesh"), ("--mesh-interface", "a/b", "--mesh-interface"),
                               ("--mesh-port", "0", "--mesh-port")):
        code = main(["--config", str(tmp_path / "empty.toml"), "--state-dir", str(tmp_path / "state"), flag, value])
        err = capsys.readouterr().err
        assert code == 2 and "configuration error" in err and named in err, (flag, err)

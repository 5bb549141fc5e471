import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "swarmd.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_verifies(tmp_path):
    # verify checks that ExecStart exists: point it at this checkout's swarmd.
    swarmd = shutil.which("swarmd") or str(Path(__import__("sys").executable).parent / "swarmd")
    unit = tmp_path / "swarmd.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/swarmd", swarmd))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "swarmd.service" not in proc.stderr, proc.stderr  # no warnings about our unit


def test_unit_has_what_the_daemon_relies_on():
    text = UNIT.read_text()
    for line in ["Type=notify", "WatchdogSec=", "Restart=on-failure", "RestartPreventExitStatus=2",
                 "StateDirectory=swarmd", "RuntimeDirectory=swarmd", "ConfigurationDirectory=swarmd",
                 "CAP_NET_ADMIN", "NoNewPrivileges=yes", "ProtectSystem=strict"]:
        assert line in text, line


def unit_settings() -> dict[str, list[str]]:
    """[Service] settings of the shipped unit, each key's values in order (keys may repeat)."""
    out: dict[str, list[str]] = {}
    section = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def writable_under_the_unit(settings: dict[str, list[str]]) -> list[Path]:
    """What ProtectSystem=strict leaves writable: the unit's own directories, ReadWritePaths=, and
    /tmp (private)."""
    words = lambda key: [w for v in settings.get(key, []) for w in v.split()]  # noqa: E731
    return ([Path("/var/lib") / d for d in words("StateDirectory")] + [Path("/run") / d for d in words("RuntimeDirectory")]
            + [Path(p.lstrip("-")) for p in words("ReadWritePaths")]
            + ([Path("/tmp")] if settings.get("PrivateTmp") == ["yes"] else []))


def systemd_env(settings: dict[str, list[str]]) -> dict[str, str]:
    """The environment systemd gives the service for its directories (systemd.exec(5))."""
    words = lambda key: [w for v in settings.get(key, []) for w in v.split()]  # noqa: E731
    return {"STATE_DIRECTORY": ":".join(f"/var/lib/{d}" for d in words("StateDirectory")),
            "RUNTIME_DIRECTORY": ":".join(f"/run/{d}" for d in words("RuntimeDirectory"))}


def paths_the_daemon_writes(env: dict[str, str]) -> dict[str, Path]:
    from swarmd import paths
    from swarmd.config import Config
    from swarmd.wg.userspace import SOCKET_DIR

    state = paths.default_state_dir(env, uid=0)
    config = Config(state_dir=state)
    return {"state dir": state, "jobs dir": config.jobs_path, "socket": paths.default_socket(state, env, uid=0),
            "wireguard-go UAPI sockets": Path(str(SOCKET_DIR).replace("/var/run/", "/run/", 1))}  # /var/run -> /run


@pytest.mark.parametrize("with_env", [True, False], ids=["systemd's environment", "no environment"])
def test_every_default_path_the_daemon_writes_is_writable_under_the_units_hardening(with_env):
    settings = unit_settings()
    assert settings["ProtectSystem"] == ["strict"], "this test assumes the whole file system read-only"
    writable = writable_under_the_unit(settings)
    for what, path in paths_the_daemon_writes(systemd_env(settings) if with_env else {}).items():
        assert any(path == w or w in path.parents for w in writable), \
            f"{what} {path} is read-only under the unit (writable: {', '.join(map(str, writable))})"


def test_the_state_dir_stays_private_and_jobs_live_beside_it():
    settings = unit_settings()
    assert settings["StateDirectoryMode"] == ["0700"]
    written = paths_the_daemon_writes(systemd_env(settings))
    assert written["state dir"] not in written["jobs dir"].parents, \
        "job users must reach the jobs dir, which a 0700 state dir would block"
    assert settings.get("RuntimeDirectoryPreserve") == ["yes"], \
        "/run/wireguard is shared with other wireguard-go users: stopping swarmd must not remove it"

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

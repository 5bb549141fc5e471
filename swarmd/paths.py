"""Default locations, shared by swarmd and swarmctl (import-light).

As root (a system service) state lives in /var/lib/swarmd and the control socket in
/run/swarmd; systemd's StateDirectory=/RuntimeDirectory= override those through
$STATE_DIRECTORY/$RUNTIME_DIRECTORY. A user's daemon keeps both under
$XDG_STATE_HOME/swarmd (XDG Base Directory spec; ~/.local/state when unset).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SYSTEM_STATE_DIR = Path("/var/lib/swarmd")
SYSTEM_SOCKET = Path("/run/swarmd/swarmd.sock")
SYSTEM_CONFIG = Path("/etc/swarmd/swarmd.toml")
SOCKET_NAME = "swarmd.sock"


def default_state_dir(env: Mapping[str, str] = os.environ, uid: int | None = None) -> Path:
    if env.get("STATE_DIRECTORY"):
        return Path(env["STATE_DIRECTORY"].split(":")[0])
    if (os.getuid() if uid is None else uid) == 0:
        return SYSTEM_STATE_DIR
    base = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".local" / "state")
    return Path(base) / "swarmd"


def default_socket(state_dir: Path, env: Mapping[str, str] = os.environ, uid: int | None = None) -> Path:
    if env.get("RUNTIME_DIRECTORY"):
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / SOCKET_NAME
    if (os.getuid() if uid is None else uid) == 0:
        return SYSTEM_SOCKET
    return state_dir / SOCKET_NAME


def client_socket(env: Mapping[str, str] = os.environ) -> Path:
    """Where swarmctl looks: $SWARMD_SOCKET, else the system daemon, else the user's."""
    if env.get("SWARMD_SOCKET"):
        return Path(env["SWARMD_SOCKET"])
    if os.getuid() == 0 or SYSTEM_SOCKET.exists():
        return SYSTEM_SOCKET
    return default_socket(default_state_dir(env), env)

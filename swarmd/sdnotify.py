"""systemd's notify protocol (sd_notify(3)): READY=1, WATCHDOG=1, STOPPING=1, STATUS=…

A datagram to $NOTIFY_SOCKET; a leading '@' names an abstract socket. Written here rather
than taken from a package because it is one sendto() and the packages for it either wrap
libsystemd (a C build dependency) or are unmaintained. Without $NOTIFY_SOCKET every call
is a no-op, so the daemon runs the same by hand, in tests and under systemd.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        address = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        wanted = usec.isdigit() and (not pid or pid == str(os.getpid()))
        self.watchdog_interval: float | None = int(usec) / 2e6 if wanted else None  # ping at half, as sd_watchdog_enabled(3) advises

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, *lines: str) -> None:
        if not self._address:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            try:
                sock.sendto("\n".join(lines).encode(), self._address)
            except OSError:
                pass  # systemd gone or not listening: nothing to tell

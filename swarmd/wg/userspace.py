"""The wireguard-go backend: a supervised ``wireguard-go -f IFACE`` child configured over UAPI.

Facts this module is built on (DESIGN, and wireguard-go's main.go / ipc/uapi_linux.go):
- wireguard-go's self-daemonizing mode died under ``ip netns exec``, so it runs in the
  foreground (``-f``) as our child and we supervise it.
- Its UAPI socket is ``/var/run/wireguard/IFACE.sock``, compiled in, and that directory is
  shared by every network namespace: two hosts on one machine need distinct interface names.
- It watches its socket file (inotify) and exits when the file is deleted, taking its TUN
  interface with it. So deleting a leftover socket is how an orphaned wireguard-go from a
  crashed run (the daemon SIGKILLed, say) is stopped; a socket whose owner is dead is simply
  stale. A live socket with no interface of that name in our namespace belongs to another
  namespace's wireguard-go: that is a name clash and start refuses it.
- The TUN interface lives exactly as long as the process (it holds the only fd), so a
  restart must set key, port, addresses, MTU and every peer again.

Its output goes through a pipe read by a thread into the structlog logger (a thread, so that
the pipe is drained even when nobody runs ``supervise``: a full pipe would block
wireguard-go's logging and with it the device).
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path

import structlog
import trio

from .backend import (
    INSTALL_WG_GO,
    BackendError,
    BackendUnavailable,
    check_ifname,
    check_link_settings,
    configure_link,
    delete_link,
    link_index,
    set_link_addresses,
)
from .uapi import KEY_LEN, DeviceState, PeerConfig, UapiError, encode_set, uapi_get, uapi_set

log = structlog.get_logger("swarmd.wg")

BINARY = "wireguard-go"
SOCKET_DIR = Path("/var/run/wireguard")  # wireguard-go's socketDirectory (ipc/uapi_unix.go)
READY_TIMEOUT = 10.0  # spawn to answering UAPI; measured ~30 ms here, slower on a loaded host
STOP_TIMEOUT = 5.0  # SIGTERM to exit before SIGKILL; it exits in milliseconds when healthy
ORPHAN_EXIT_TIMEOUT = 3.0  # an orphan's exit after its socket is deleted (inotify)
RESTART_DELAY_MIN = 0.5  # a crash loop backs off from here...
RESTART_DELAY_MAX = 30.0  # ...doubling up to here;
STABLE_AFTER = 60.0  # a process that lived this long died once: restart it at once
OUTPUT_TAIL = 20  # last output lines kept for error messages
POLL = 0.02


class UserspaceBackend:
    """wireguard-go as a supervised child. Not safe to share between trio runs."""

    name = "userspace"

    def __init__(self, iface: str, *, binary: str = BINARY, verbose: bool = False,
                 uapi_timeout: float = 5.0) -> None:
        self.iface = check_ifname(iface)
        self.socket_path = SOCKET_DIR / f"{iface}.sock"
        self.restarts = 0
        self._binary = binary
        self._verbose = verbose
        self._uapi_timeout = uapi_timeout
        self._proc: trio.Process | None = None
        self._relay: _OutputRelay | None = None
        self._settings: tuple[bytes, int, list[str], int] | None = None
        self._started_at = 0.0
        self._closing = False
        self._lock = trio.Lock()  # start, restart and close never interleave
        self._log = log.bind(iface=iface)

    @property
    def pid(self) -> int | None:
        """The running wireguard-go's pid, None when there is none."""
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    async def start(self, *, private_key: bytes, listen_port: int, addresses: Sequence[str],
                    mtu: int) -> None:
        if not isinstance(private_key, bytes) or len(private_key) != KEY_LEN:
            raise ValueError(f"private key must be {KEY_LEN} bytes")
        check_link_settings(listen_port, addresses, mtu)
        async with self._lock:
            if self.pid is not None:
                raise BackendError(f"{self.iface}: already started (wireguard-go pid {self.pid})")
            self._closing = False
            self._settings = (private_key, listen_port, list(addresses), mtu)
            await self._launch()

    async def set_peers(self, peers: Iterable[PeerConfig]) -> None:
        data = encode_set(peers=peers)
        if data != b"set=1\n\n":
            await self._set(data)

    async def set_addresses(self, addresses: Sequence[str]) -> None:
        if self._settings is None:
            raise BackendError(f"{self.iface}: set_addresses() before start()")
        private_key, listen_port, _, mtu = self._settings
        check_link_settings(listen_port, addresses, mtu)  # an IPv6 address needs MTU >= 1280
        async with self._lock:  # not halfway through a restart, which reads the settings
            self._settings = (private_key, listen_port, list(addresses), mtu)
            await trio.to_thread.run_sync(set_link_addresses, self.iface, list(addresses))

    async def set_private_key(self, key: bytes) -> None:
        await self._set(encode_set(private_key=key))
        if self._settings is not None:
            self._settings = (key, *self._settings[1:])

    async def state(self) -> DeviceState:
        try:
            return await uapi_get(self.socket_path, timeout=self._uapi_timeout)
        except UapiError as e:
            raise BackendError(f"{self.iface}: {e}") from e

    async def supervise(self, on_restart: Callable[[], Awaitable[object]]) -> None:
        """Restart wireguard-go whenever it dies unexpectedly, then await ``on_restart()``.

        Returns when ``close`` is called. Never raises for a crash or a failed restart: it
        logs, backs off and tries again; an exception from ``on_restart`` is logged too.
        """
        if self._settings is None:
            raise BackendError(f"{self.iface}: supervise() before start()")
        delay, relaunch_failed = 0.0, False
        while not self._closing:
            proc = self._proc
            if proc is not None:
                await proc.wait()
            async with self._lock:
                if self._closing:
                    return
                if self._proc is not proc and self.pid is not None:
                    continue  # replaced meanwhile
                lived = time.monotonic() - self._started_at
                if lived > STABLE_AFTER:
                    delay = 0.0
                if not relaunch_failed:
                    self._log.error("wireguard-go died; restarting", status=proc.returncode if proc else None,
                                    lived_s=round(lived, 3), retry_in_s=delay,
                                    output=self._relay.tail() if self._relay else "")
            await trio.sleep(delay)
            delay = min(max(2 * delay, RESTART_DELAY_MIN), RESTART_DELAY_MAX)
            async with self._lock:
                if self._closing:
                    return
                try:
                    await self._launch()
                except Exception as e:  # whatever it is, the next attempt may fare better
                    self._log.error("wireguard-go restart failed", error=str(e), retry_in_s=delay,
                                    exc_info=not isinstance(e, BackendError))
                    relaunch_failed = True
                    continue
                relaunch_failed = False
                self.restarts += 1
                self._log.warning("wireguard-go restarted", pid=self.pid, restarts=self.restarts)
            try:
                await on_restart()
            except Exception:  # the caller's bug must not stop supervision
                self._log.exception("on_restart failed after a wireguard-go restart")

    async def close(self) -> None:
        """Stop wireguard-go (SIGTERM, then SIGKILL) and leave no interface and no socket."""
        with trio.CancelScope(shield=True):
            self._closing = True
            async with self._lock:
                if self._proc is None:
                    return  # never ran: the socket and interface of that name are not ours
                await self._stop(self._proc)
                self._proc = None
                self.socket_path.unlink(missing_ok=True)
                if await trio.to_thread.run_sync(delete_link, self.iface):
                    self._log.warning("deleted the interface wireguard-go left behind")

    # -- internals ------------------------------------------------------------------------

    async def _set(self, data: bytes) -> None:
        try:
            await uapi_set(self.socket_path, data, timeout=self._uapi_timeout)
        except UapiError as e:
            raise BackendError(f"{self.iface}: {e}") from e

    async def _launch(self) -> None:
        """Spawn wireguard-go and configure it from ``self._settings``. Holds the lock."""
        assert self._settings is not None
        binary = shutil.which(self._binary)
        if binary is None:
            raise BackendUnavailable(f"wireguard-go not found: {INSTALL_WG_GO}")
        private_key, listen_port, addresses, mtu = self._settings
        await self._clear_leftovers()
        read_end, write_end = os.pipe()
        try:
            env = {**os.environ, "WG_PROCESS_FOREGROUND": "1",  # also silences its kernel-module banner
                   "LOG_LEVEL": "verbose" if self._verbose else "error"}
            # Own session: a Ctrl-C meant for the daemon must not kill the mesh before we close it.
            proc = await trio.lowlevel.open_process(
                [binary, "-f", self.iface], stdin=subprocess.DEVNULL, stdout=write_end,
                stderr=write_end, env=env, start_new_session=True)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self._proc, self._started_at = proc, time.monotonic()
        self._relay = _OutputRelay(read_end, self._log.bind(pid=proc.pid))
        try:
            await self._wait_ready(proc)
            try:
                await uapi_set(self.socket_path, encode_set(private_key=private_key, listen_port=listen_port),
                               timeout=self._uapi_timeout)
            except UapiError as e:
                raise BackendError(f"{self.iface}: cannot set key and listen port {listen_port}: {e}") from e
            await trio.to_thread.run_sync(configure_link, self.iface, addresses, mtu)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._stop(proc)
                self.socket_path.unlink(missing_ok=True)
            raise
        self._log.info("wireguard-go started", pid=proc.pid, listen_port=listen_port,
                       addresses=addresses, mtu=mtu, ready_s=round(time.monotonic() - self._started_at, 3))

    async def _wait_ready(self, proc: trio.Process) -> None:
        deadline = trio.current_time() + READY_TIMEOUT
        while True:
            if proc.poll() is not None:
                await self._relay_done()
                raise BackendError(f"wireguard-go -f {self.iface} exited with status {proc.returncode} "
                                   f"while starting: {self._relay.tail() or '(no output)'}")
            if self.socket_path.exists():
                try:
                    await uapi_get(self.socket_path, timeout=1.0)
                    return
                except UapiError:
                    pass
            if trio.current_time() > deadline:
                raise BackendError(f"wireguard-go -f {self.iface} did not answer on {self.socket_path} "
                                   f"within {READY_TIMEOUT:g} s: {self._relay.tail() or '(no output)'}")
            await trio.sleep(POLL)

    async def _clear_leftovers(self) -> None:
        """Remove what a crashed earlier run left: a stale socket, an orphaned wireguard-go
        (deleting its socket makes it exit), an interface of our name."""
        path = self.socket_path
        if path.exists() or path.is_symlink():
            live = await _answers(path)
            here = await trio.to_thread.run_sync(link_index, self.iface) is not None
            if live and not here:
                raise BackendError(
                    f"{path} belongs to a wireguard-go running in another network namespace (no "
                    f"interface {self.iface} here): give each host a distinct interface name")
            self._log.warning("removing a leftover UAPI socket", path=str(path),
                              orphan_running=live)
            path.unlink(missing_ok=True)
        deadline = trio.current_time() + ORPHAN_EXIT_TIMEOUT
        while await trio.to_thread.run_sync(link_index, self.iface) is not None:
            if trio.current_time() > deadline:
                await trio.to_thread.run_sync(delete_link, self.iface)
                self._log.warning("deleted a leftover interface")
                break
            await trio.sleep(POLL)

    async def _stop(self, proc: trio.Process) -> None:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(STOP_TIMEOUT):
                await proc.wait()
            if proc.returncode is None:
                self._log.warning("wireguard-go ignored SIGTERM; killing it", pid=proc.pid)
                proc.kill()
                await proc.wait()
        await self._relay_done()

    async def _relay_done(self) -> None:
        if self._relay is not None:
            await trio.to_thread.run_sync(self._relay.join, 2.0)


async def _answers(path: Path) -> bool:
    try:
        await uapi_get(path, timeout=1.0)
        return True
    except UapiError:
        return False


class _OutputRelay:
    """Reads wireguard-go's stdout+stderr in a thread; logs each line, keeps the last few."""

    def __init__(self, fd: int, logger: structlog.typing.FilteringBoundLogger) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL)
        self._log = logger
        self._thread = threading.Thread(target=self._run, args=(fd,), daemon=True,
                                        name=f"wireguard-go output {fd}")
        self._thread.start()

    def tail(self) -> str:
        return " | ".join(self._lines)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self, fd: int) -> None:
        with open(fd, "rb") as pipe:
            for raw in pipe:
                line = raw.decode(errors="replace").rstrip()
                if not line:
                    continue
                self._lines.append(line)
                # Its logger prefixes "ERROR: (iface) " or "DEBUG: (iface) " (device/logger.go).
                level = "debug" if line.startswith("DEBUG") else "warning"
                getattr(self._log, level)("wireguard-go", line=line)

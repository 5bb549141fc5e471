"""Backend choice and the errors a backend gives before it touches the network.

This machine's kernel has no WireGuard module (DESIGN), so the kernel backend is only
checked for saying so clearly; wireguard-go itself runs in tests/netlab/test_wg_backend.py.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

from swarmd.wg import backend, kernel, userspace
from swarmd.wg import choose
from swarmd.wg.backend import BackendError, BackendUnavailable
from swarmd.wg.userspace import UserspaceBackend

HAS_MODULE = Path("/sys/module/wireguard").exists()
no_module = pytest.mark.skipif(HAS_MODULE, reason="this kernel has the WireGuard module")
KEY = bytes(32)


@pytest.fixture
def no_wireguard_go(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))


@no_module
def test_kernel_backend_unavailable_here():
    assert kernel.available() is False


@no_module
def test_forcing_kernel_says_why():
    with pytest.raises(BackendUnavailable, match="'kernel' is unavailable: this kernel has no WireGuard "
                                                 "module.*modprobe wireguard.*'userspace'"):
        choose("kernel", "swt0")


@no_module
@pytest.mark.skipif(os.geteuid() != 0, reason="creating a link needs root")
async def test_kernel_backend_start_says_why():
    with pytest.raises(BackendUnavailable, match="cannot create WireGuard interface swtk0: this kernel has no"):
        await kernel.KernelBackend("swtk0").start(private_key=KEY, listen_port=0, addresses=[], mtu=1420)


@no_module
def test_auto_falls_back_to_wireguard_go():
    b = choose("auto", "swt0")
    assert isinstance(b, UserspaceBackend) and b.name == "userspace" and b.iface == "swt0"


def test_forced_userspace():
    assert choose("userspace", "swt0").name == "userspace"


def test_forced_userspace_without_binary(no_wireguard_go):
    with pytest.raises(BackendUnavailable, match="^wireguard-go not found: apt-get install wireguard-go$"):
        choose("userspace", "swt0")


@no_module
def test_auto_with_nothing_names_both_options(no_wireguard_go):
    with pytest.raises(BackendUnavailable, match="no WireGuard backend: .*modprobe wireguard.*"
                                                 "apt-get install wireguard-go"):
        choose("auto", "swt0")


def test_unknown_preference():
    with pytest.raises(ValueError, match="one of auto, kernel, userspace, got 'wireguard'"):
        choose("wireguard", "swt0")


async def test_userspace_start_without_binary(no_wireguard_go):
    with pytest.raises(BackendUnavailable, match="^wireguard-go not found: apt-get install wireguard-go$"):
        await UserspaceBackend("swt0").start(private_key=KEY, listen_port=0, addresses=[], mtu=1420)


def fake_binary(tmp_path: Path, script: str) -> str:
    path = tmp_path / "fake-wireguard-go"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return str(path)


async def test_wireguard_go_dying_at_start_is_reported_with_its_output(tmp_path):
    binary = fake_binary(tmp_path, 'echo "ERROR: (swtfake0) Failed to create TUN device: no /dev/net/tun"; exit 1')
    b = UserspaceBackend("swtfake0", binary=binary)
    with pytest.raises(BackendError, match=r"wireguard-go -f swtfake0 exited with status 1 while starting: "
                                           r"ERROR: \(swtfake0\) Failed to create TUN device"):
        await b.start(private_key=KEY, listen_port=0, addresses=[], mtu=1420)
    assert b.pid is None
    await b.close()


async def test_wireguard_go_that_never_answers_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(userspace, "READY_TIMEOUT", 0.3)
    b = UserspaceBackend("swtfake1", binary=fake_binary(tmp_path, "exec sleep 60"))
    with pytest.raises(BackendError, match=r"did not answer on /var/run/wireguard/swtfake1.sock within 0.3 s"):
        await b.start(private_key=KEY, listen_port=0, addresses=[], mtu=1420)
    assert b.pid is None  # SIGTERMed and reaped
    await b.close()


@pytest.mark.parametrize("name", ["", "a" * 16, "a/b", "a b", "a:1", ".", ".."])
def test_bad_interface_names(name):
    with pytest.raises(ValueError, match="interface name must be 1-15 bytes"):
        UserspaceBackend(name)
    with pytest.raises(ValueError, match="interface name"):
        kernel.KernelBackend(name)


BAD_SETTINGS = [
    ({"private_key": b"x"}, "private key must be 32 bytes"),
    ({"listen_port": 70000}, "listen port must be 0..65535"),
    ({"addresses": ["10.211.0.1"]}, "overlay address must be CIDR"),
    ({"addresses": ["10.211.0.300/16"]}, "overlay address must be CIDR"),
    ({"addresses": "10.211.0.1/16"}, "a list of CIDR strings, got the string"),
    ({"mtu": 100}, "MTU must be 576..65535"),
    ({"addresses": ["fd11::1/64"], "mtu": 1000}, "MTU must be 1280..65535"),
]


@pytest.mark.parametrize("change,message", BAD_SETTINGS)
async def test_bad_start_settings_rejected_before_anything_runs(change, message):
    settings = {"private_key": KEY, "listen_port": 51820, "addresses": ["10.211.0.1/16"], "mtu": 1420, **change}
    for b in (UserspaceBackend("swt0"), kernel.KernelBackend("swt0")):
        with pytest.raises(ValueError, match=message):
            await b.start(**settings)


@pytest.mark.parametrize("cls", [UserspaceBackend, kernel.KernelBackend])
def test_backends_match_the_protocol(cls):
    for attr in ("start", "set_peers", "set_addresses", "set_private_key", "state", "supervise", "close"):
        expected = inspect.signature(getattr(backend.Backend, attr))
        assert inspect.signature(getattr(cls, attr)).parameters.keys() == expected.parameters.keys(), attr
        assert inspect.iscoroutinefunction(getattr(cls, attr)), attr

import subprocess
import sys
from pathlib import Path

import pytest

from swarmd import config
from swarmd.config import ConfigError, load


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "swarmd.toml"
    path.write_text(text)
    return path


def test_defaults_without_a_file(tmp_path):
    c = load(config_file=write(tmp_path, ""), env={})
    assert c.listen == ("/ip4/0.0.0.0/tcp/4001",)
    assert c.metrics_addr == "127.0.0.1:9464"
    assert c.log_level == "info"


def test_flags_beat_environment_beat_file(tmp_path):
    path = write(tmp_path, 'log_level = "debug"\nmetrics_addr = "127.0.0.1:1"\nstate_dir = "/srv/a"\n')
    env = {"SWARMD_LOG_LEVEL": "warning", "SWARMD_METRICS_ADDR": "off"}
    c = load(config_file=path, env=env, flags={"log_level": "error", "state_dir": None})
    assert c.log_level == "error"          # flag
    assert c.metrics_addr is None          # environment ('off')
    assert c.state_dir == Path("/srv/a")   # file; an absent flag (None) does not override


def test_lists_from_environment_are_comma_separated(tmp_path):
    env = {"SWARMD_LISTEN": "/ip4/127.0.0.1/tcp/1, /ip4/127.0.0.1/tcp/2"}
    c = load(config_file=write(tmp_path, ""), env=env)
    assert c.listen == ("/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2")


@pytest.mark.parametrize("text, message", [
    ("colour = 1\n", "key 'colour': unknown key (known keys:"),
    ("listen = 4001\n", "key 'listen': expected a list of multiaddr strings"),
    ('listen = ["/ip4/1.2.3.4/udp/1"]\n', "with /tcp/"),
    ('listen = ["not an address"]\n', "does not parse"),
    ('bootstrap = ["/ip4/1.2.3.4/tcp/1"]\n', "with /p2p/"),
    ('metrics_addr = "localhost"\n', "expected HOST:PORT with a port 0-65535, or 'off', got 'localhost'"),
    ('metrics_addr = "127.0.0.1:70000"\n', "HOST:PORT"),
    ('log_level = "loud"\n', "expected one of debug, info, warning, error, got 'loud'"),
    ('state_dir = ""\n', "expected a non-empty path string"),
    ("log_level = \n", "not valid TOML"),
])
def test_bad_file_names_file_key_and_expectation(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load(config_file=path, env={})
    assert str(path) in str(err.value)
    assert message in str(err.value)


def test_bad_environment_names_the_variable(tmp_path):
    with pytest.raises(ConfigError, match="environment SWARMD_LOG_LEVEL: expected one of"):
        load(config_file=write(tmp_path, ""), env={"SWARMD_LOG_LEVEL": "loud"})


def test_missing_explicit_file(tmp_path):
    with pytest.raises(ConfigError, match="no such configuration file"):
        load(config_file=tmp_path / "nope.toml", env={})


def test_every_key_is_documented():
    for f in config.fields(config.Config):
        assert f.metadata.get("doc"), f"Config.{f.name} has no doc"


@pytest.mark.parametrize("args, message", [
    (["--metrics-addr", "nowhere"], "flag --metrics-addr: expected HOST:PORT"),
    (["--listen", "/ip4/127.0.0.1/udp/9"], "flag --listen: expected multiaddrs with /tcp/"),
])
def test_daemon_exits_2_on_bad_config(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "swarmd.main", "--config", str(write(tmp_path, "")),
                           "--state-dir", str(tmp_path / "s"), *args],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (tmp_path / "s").exists()  # refused before touching any state


def test_daemon_exits_2_on_bad_file(tmp_path):
    path = write(tmp_path, "listen = 5\n")
    proc = subprocess.run([sys.executable, "-m", "swarmd.main", "--config", str(path)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert f"{path}: key 'listen': expected a list of multiaddr strings" in proc.stderr


def test_relay_ports_may_not_include_the_mesh_port(tmp_path):
    from swarmd.config import ConfigError, load

    with pytest.raises(ConfigError, match="relay_ports 51800-51900 includes mesh_port 51820"):
        load(config_file=None, env={}, flags={"relay_ports": "51800-51900"})
    assert load(config_file=None, env={}, flags={"relay_ports": "51800-51900", "mesh_port": "51799"}).relay_ports \
        == (51800, 51900)
    with pytest.raises(ConfigError, match="UDP port range"):
        load(config_file=None, env={}, flags={"relay_ports": "9-2"})
    with pytest.raises(ConfigError, match="within 1024-65535"):  # members refuse privileged grants
        load(config_file=None, env={}, flags={"relay_ports": "1000-2000"})

"""Ray jobs on a 3-host lab (issue 14): one Ray cluster per job over the real mesh, each node
in its job's sandbox, driven by the real `swarmctl jobs run --ray` as a user would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .support import call, rank_lines, swarmctl, three_hosts, until

pytestmark = [pytest.mark.netlab, pytest.mark.slow]
EXAMPLES = Path(__file__).parents[2] / "examples"

SPREAD = """
import json, os, socket, sys
import ray
ray.init()
nodes = [n for n in ray.nodes() if n["Alive"]]
@ray.remote(num_cpus=1)
def where():
    import time
    time.sleep(0.5)
    return ray.util.get_node_ip_address(), os.getuid()
seen = ray.get([where.options(scheduling_strategy="SPREAD").remote() for _ in range(9)])
print("RESULT " + json.dumps({"nodes": sorted(n["NodeManagerAddress"] for n in nodes),
      "cpus": sorted(n["Resources"].get("CPU", 0) for n in nodes), "ips": sorted({ip for ip, _ in seen}),
      "uids": sorted({uid for _, uid in seen}), "driver_uid": os.getuid(), "address": os.environ["RAY_ADDRESS"]}),
      flush=True)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


@pytest.fixture(scope="module")
def rl():
    with three_hosts("r", mesh=True) as lab:
        yield lab


def workdir(tmp_path: Path, script: str) -> Path:
    d = tmp_path / "work"
    d.mkdir(exist_ok=True)
    (d / "job.py").write_text(script)
    return d


def result(stdout: str) -> dict:
    line = next(t for texts in rank_lines(stdout).values() for t in texts if t.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_a_ray_job_gets_a_cluster_of_its_hosts_and_its_drivers_exit_code(rl, tmp_path):
    r = swarmctl(rl, "h1", "jobs", "run", "--ray", "--nodes", "3", "--env", "EXIT=3",
                 "--workdir", str(workdir(tmp_path, SPREAD)), "--", "python", "job.py")
    assert r.returncode == 3, r.stdout[-4000:] + r.stderr[-3000:]
    got = result(r.stdout)
    overlay = sorted(call(rl, h.name, "status")["mesh"]["address"] for h in rl.state.hosts)
    assert got["nodes"] == overlay, "one Ray node per host, on its overlay address"
    assert got["cpus"] == [1.0, 1.0, 1.0], "Ray counts the share of cores the job has on each host"
    assert got["ips"] == overlay, "tasks ran on every node"
    assert 0 not in got["uids"] and got["driver_uid"] != 0, "Ray runs as the job's uid, never root"
    assert got["address"].split(":")[0] in overlay

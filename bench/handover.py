"""Hand-over (issue 26), what is built so far: the cost of keeping a job's record on its
replicas. Per transition the coordinator signs one record and each replica verifies it and
writes it to disk (fsync): its size, the signing and verifying, and the write are measured
here on a 3-host job's record after two restarts. The crash-to-successor figures come with
the successor."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import msgpack
from nacl.signing import SigningKey

from swarmd.compute.coordinator.replication import Store
from swarmd.compute.coordinator.run import Run
from swarmd.compute.succession import Charter, Record, spec_digest
from swarmd.p2p.signed import peer_from_key, peer_str

ROUNDS = 200


def _peer(key: SigningKey) -> str:
    return peer_str(peer_from_key(bytes(key.verify_key)))


def _state(hosts: list[str]) -> dict:
    run = Run(job="0123456789ab", max_restarts=3)
    for attempt in range(3):
        if attempt:
            run.begin_attempt()
        run.to("reserving")
        run.placed(tuple(hosts), now=time.time())
        run.to("shipping")
        run.to("starting")
        for h in hosts:
            run.node_started(h, now=time.time())
        if attempt < 2:
            run.node_lost(hosts[-1], "membership: dead", now=time.time())
            for h in hosts[:-1]:
                run.node_exited(h, {hosts.index(h): 143}, now=time.time())
    spec = {"cmd": ["python", "ddp_digits.py", "--epochs", "15"], "nodes": [3, 3], "max_restarts": 3,
            "env": {"TORCH_CPP_LOG_LEVEL": "ERROR"}}
    return {"run": run.to_wire(), "spec": spec, "workdir": "ab" * 32, "ray": None, "name": "digits",
            "created": time.time(), "started": time.time()}


def figures() -> dict[str, float]:
    keys = [SigningKey.generate() for _ in range(4)]
    origin, hosts = _peer(keys[0]), [_peer(k) for k in keys[1:]]
    sign = lambda data: keys[0].sign(data).signature  # noqa: E731
    state = _state(hosts)
    charter = Charter.make(origin=origin, job="0123456789ab", owner_uid=1000, spec=spec_digest(state["spec"]),
                           hosts=hosts, sign=sign)
    body = msgpack.packb(state, use_bin_type=True)
    make, opened, puts = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(hosts[0], Path(tmp) / "replicas")
        store.load()
        for seq in range(1, ROUNDS + 1):
            t0 = time.perf_counter()
            record = Record.make(charter, 0, seq, body, sign)
            t1 = time.perf_counter()
            Record.open(record.blob)
            t2 = time.perf_counter()
            assert store.put(record) is None
            t3 = time.perf_counter()
            make.append((t1 - t0) * 1000)
            opened.append((t2 - t1) * 1000)
            puts.append((t3 - t2) * 1000)
    q = lambda xs, p: statistics.quantiles(xs, n=100, method="inclusive")[p - 1]  # noqa: E731
    return {"handover_record_bytes_3_hosts": float(len(record.blob)),
            "handover_bytes_per_transition_all_replicas": float(len(record.blob) * (len(charter.replicas) - 1)),
            "handover_record_sign_p50_ms": statistics.median(make),
            "handover_record_verify_p50_ms": statistics.median(opened),
            "handover_replica_write_p50_ms": statistics.median(puts),
            "handover_replica_write_p95_ms": q(puts, 95)}


if __name__ == "__main__":
    for k, v in figures().items():
        print(f"{k}: {v:.3f}")

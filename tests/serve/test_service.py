"""A node's controllers (swarmd/serve/service.py), driven round by round with a fake job service:
one service's failing round never stalls another's, and a file left on disk that does not
read back is set aside, never a reason not to start."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from swarmd.gossip.membership import View
from swarmd.serve.control import DRAIN_S
from swarmd.serve.service import Services

ME = "12D3KooWQxJFwLvM8tqMXsRu4DoYhA7dsr6kSdo1ZiQ4jDwPVu1b"


class Jobs:
    def __init__(self) -> None:
        self.rows: dict[str, SimpleNamespace] = {}
        self.ids = (f"job{i}" for i in itertools.count())
        self.worker = SimpleNamespace(serving={})
        self.store = SimpleNamespace(get=self.rows.get)

    def submit(self, spec, workdir, uid) -> str:
        job = next(self.ids)
        self.rows[job] = SimpleNamespace(state="running", nodes=["h"])
        return job

    def cancel(self, job: str) -> str:
        raise KeyError(job)  # as Jobs.cancel does for a job its store no longer holds


def services(tmp_path) -> tuple[Services, Jobs]:
    jobs = Jobs()
    gossip = SimpleNamespace(me=ME, view=lambda: View.empty(ME), own_record=None, readvertise=lambda: None)
    return Services(jobs=jobs, gossip=gossip, state_dir=tmp_path, rtt=lambda h: None, path=lambda h: None,
                    gateway_listen=None, socket_path=tmp_path / "s.sock"), jobs


def up(s: Services, name: str, replicas: int = 1) -> None:
    s.up({"name": name, "replicas": replicas, "template": {"cmd": ["python", "app.py"]}}, owner=0, admin=True)


def test_a_service_whose_round_fails_does_not_stall_the_others(tmp_path, monkeypatch):
    s, jobs = services(tmp_path)
    up(s, "a")
    up(s, "b")
    real_save = s._save
    monkeypatch.setattr(s, "_save", lambda name: (_ for _ in ()).throw(OSError(28, "No space left")) if name == "a"
                        else real_save(name))
    s.step(0.0)
    assert {c.slots[0].job is not None for c in s.controllers.values()} == {True}, "b's replica started as a's"


def test_a_replica_job_gone_from_the_store_is_forgotten_when_it_drains(tmp_path):
    s, jobs = services(tmp_path)
    up(s, "a")
    s.step(0.0)
    s.scale("a", 0, owner=0, admin=True)
    s.step(1.0)
    s.step(1.0 + DRAIN_S)  # the stop meets a job the store no longer holds
    s.step(2.0 + DRAIN_S)
    assert "a" not in s.specs and not (tmp_path / "services" / "a.json").exists()


def test_a_service_file_that_does_not_read_back_is_set_aside(tmp_path):
    d = tmp_path / "services"
    d.mkdir()
    (d / "bad.json").write_text('{"spec": {"name": "bad", "owner": "x"}}')
    (d / "junk.json").write_bytes(b"\xff\x00not json")
    s, _ = services(tmp_path)
    up(s, "good")
    s.step(0.0)
    assert set(s.specs) == {"good"} and (d / "bad.bad").exists() and (d / "junk.bad").exists()
    again, _ = services(tmp_path)
    assert set(again.specs) == {"good"}, "what was written comes back after a restart"

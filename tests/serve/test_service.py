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


# --- autoscaling (issue 28) ---------------------------------------------------------------

ASIA = "12D3KooWRBy97UB99e3J6hiPesre1MZeuNQvfan4gBziswrRJsNK"
EU = "12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"


def member(peer, rate, in_flight, free=1):
    from swarmd.gossip.registry import DemandEntry
    record = SimpleNamespace(demand=(DemandEntry(service="embed", rate=rate, in_flight=in_flight, p99_ms=80.0),),
                             jobs=SimpleNamespace(free=free))
    return SimpleNamespace(peer=peer, record=record, in_service=True)


def autoscaled(tmp_path, **policy):
    s, jobs = services(tmp_path)
    specs = []
    real = jobs.submit
    jobs.submit = lambda spec, workdir, uid: (specs.append(spec), real(spec, workdir, uid))[1]
    s.up({"name": "embed", "template": {"cmd": ["python", "app.py"]},
          "autoscale": {"min": 1, "max": 4, "target_inflight": 2.0, "stable_s": 10.0, "panic_s": 2.0,
                        "down_delay_s": 30.0, "idle_s": 60.0, **policy}}, owner=0, admin=True)
    return s, jobs, specs


def test_a_burst_of_demand_scales_an_autoscaled_service_up_at_once_and_says_why(tmp_path):
    s, jobs, specs = autoscaled(tmp_path)
    demand = [member(ASIA, 90.0, 6.0), member(EU, 10.0, 1.0)]
    s._members = lambda: demand
    for t in range(5):
        s.step(float(t))
    assert s.controllers["embed"].replicas == 4, "7 in flight at 2 a replica, with one ready: panic"
    shown = s.show("embed")["autoscale"]
    assert shown["demand"]["rate_per_s"] == 100.0 and shown["demand"]["points"][0][0] == ASIA
    assert "panic" in shown["decision"]["reason"] and shown["events"][-1]["to"] == 4
    near = {spec.serve.replica: spec.serve.near for spec in specs}
    assert near[0] == (), "the first replica was placed before any demand"
    assert near[1][0] == (ASIA, 1000) and dict(near[1])[EU] < 1000, "new replicas go where requests enter, weighed"


def test_demand_gone_scales_down_only_after_the_down_delay_then_idle_to_min(tmp_path):
    s, jobs, specs = autoscaled(tmp_path)
    busy = [member(ASIA, 90.0, 6.0)]
    s._members = lambda: busy
    for t in range(5):
        s.step(float(t))
    assert s.controllers["embed"].replicas == 3
    busy[:] = []
    for t in range(5, 30):
        s.step(float(t))
    assert s.controllers["embed"].replicas == 3, "held by the down-delay"
    for t in range(30, 90):
        s.step(float(t))
    assert s.controllers["embed"].replicas == 1
    assert s.events["embed"][-1]["to"] == 1


def test_an_autoscaled_service_and_what_its_scaler_learned_survive_a_restart(tmp_path):
    s, jobs, specs = autoscaled(tmp_path, predictive=True, season_s=120.0)
    s._members = lambda: [member(ASIA, 30.0, 2.0)]
    for t in range(40):
        s.step(float(t))
    s._save("embed")
    again, _ = services(tmp_path)
    assert again.specs["embed"].autoscale["max"] == 4 and again.scalers["embed"].policy.predictive
    assert again.scalers["embed"].to_json() == s.scalers["embed"].to_json()
    body = (tmp_path / "services" / "embed.json").read_text()
    (tmp_path / "services" / "embed.json").write_text(body.replace('"scaler": {', '"scaler": {"junk": [1e999], '))
    third, _ = services(tmp_path)
    assert "embed" in third.scalers, "a scaler state that does not read back starts afresh, never stops the load"


def test_a_bad_autoscale_request_is_refused_naming_the_field(tmp_path):
    import pytest

    from swarmd.serve.service import ServeError
    s, _ = services(tmp_path)
    for bad, words in (({"min": 0, "max": 4}, "autoscale: min"), ({"min": 3, "max": 2}, "autoscale: max"),
                       ({"min": 1}, "with min and max"), ({"min": 1, "max": 2, "warp": 9}, "with min and max"),
                       ({"min": 1, "max": 2, "target_inflight": -1}, "target_inflight"),
                       ({"min": 1, "max": 2, "season_s": float("nan")}, "season_s"),
                       ({"min": 1, "max": 2, "predictive": "yes"}, "predictive"),
                       ({"min": True, "max": 2}, "autoscale.min"), ("1:4", "autoscale")):
        with pytest.raises(ServeError, match=words):
            s.up({"name": "x", "template": {"cmd": ["x"]}, "autoscale": bad}, owner=0, admin=True)
    up(s, "fixed", 2)
    with pytest.raises(ServeError, match="autoscale: max"):
        s.scale("fixed", None, owner=0, admin=True, autoscale={"min": 1, "max": 999})
    assert s.scale("fixed", None, owner=0, admin=True, autoscale={"min": 1, "max": 3})["autoscale"]["max"] == 3
    assert s.scale("fixed", 2, owner=0, admin=True)["autoscale"] is None and "fixed" not in s.scalers


def test_a_replica_far_from_its_demand_moves_after_two_checks_in_a_row(tmp_path):
    s, jobs, specs = autoscaled(tmp_path, min=1, max=1, move_s=10.0)
    s.pair_rtt = lambda a, b: 150.0 if {a, b} == {ASIA, EU} else None
    real = jobs.submit
    jobs.submit = lambda spec, workdir, uid: (job := real(spec, workdir, uid), jobs.rows[job].__setattr__(
        "nodes", [EU]))[0]
    demand = [member(ASIA, 50.0, 1.0), SimpleNamespace(peer=EU, in_service=True,
                                                        record=SimpleNamespace(demand=(), jobs=SimpleNamespace(free=0)))]
    s._members = lambda: demand
    s.step(0.0)
    s.step(10.0)
    assert not any(slot.moving for slot in s.controllers["embed"].slots.values()), "once is not enough"
    s.step(20.0)
    assert s.controllers["embed"].slots[0].moving and "moves nearer its demand" in s.events["embed"][-1]["reason"]
    s.step(21.0)
    assert specs[-1].serve.replica == 1 and specs[-1].serve.near == ((ASIA, 1000),), "the surge goes near the demand"
    s2, _, _ = autoscaled(tmp_path / "b", min=1, max=1, move_s=10.0)
    s2._members = lambda: [member(ASIA, 50.0, 1.0, free=0)]
    for t in (0.0, 10.0, 20.0, 30.0):
        s2.step(t)
    assert not s2.controllers["embed"].slots[0].moving, "nowhere free to go: it stays"


def test_deploying_an_autoscaled_service_again_keeps_the_count_its_scaler_reached(tmp_path):
    s, jobs, specs = autoscaled(tmp_path)
    s._members = lambda: [member(ASIA, 90.0, 6.0)]
    for t in range(5):
        s.step(float(t))
    assert s.controllers["embed"].replicas == 3
    s.up({"name": "embed", "template": {"cmd": ["python", "app.py", "--v2"]},
          "autoscale": {"min": 1, "max": 4, "target_inflight": 2.0}}, owner=0, admin=True)
    assert s.controllers["embed"].replicas == 3 and s.specs["embed"].generation == 2, \
        "a roll-out of a service scaled to 3 rolls 3, not the minimum"

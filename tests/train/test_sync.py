"""Syncing rarely (swarmd/train/sync.py, env.py): the outer step by hand, the modes, what a rank
reads from its environment, and DiLoCo on three gloo ranks."""

import pytest
import torch
from torch import nn

from swarmd import train
from swarmd.train import EnvError, sync

from .ranks import run

PAPER = {"outer_lr": 0.7, "outer_momentum": 0.9}  # DiLoCo's own outer step, the hand-computed examples'


def test_the_outer_step_against_a_hand_computed_example():
    """One parameter at 1.0; the inner steps take it to 0.8, then (next round) 0.634 - 0.1 lower.
    Outer SGD, lr 0.7, Nesterov momentum 0.9 (torch's: buf = 0.9 buf + g; step g + 0.9 buf):
    round 1: g = 0.2, buf = 0.2, step 0.38, start 1 - 0.266 = 0.734;
    round 2: g = 0.1, buf = 0.28, step 0.352, start 0.734 - 0.2464 = 0.4876."""
    p = nn.Parameter(torch.tensor([1.0]))
    d = train.DiLoCo([p], every=2, **PAPER)
    with torch.no_grad():
        p.fill_(0.9)
    assert d.step() is False and p.item() == pytest.approx(0.9), "an inner step: nothing happens"
    with torch.no_grad():
        p.fill_(0.8)
    assert d.step() is True
    assert p.item() == pytest.approx(0.734) and d.start[0].item() == pytest.approx(0.734)
    with torch.no_grad():
        p.fill_(0.634)
    d.step()
    assert d.step() is True and p.item() == pytest.approx(0.4876) and d.rounds == 2


def test_outer_lr_1_without_momentum_is_parameter_averaging_and_bad_outer_values_are_refused():
    p = nn.Parameter(torch.tensor([1.0]))
    d = train.DiLoCo([p], every=1, outer_lr=1.0, outer_momentum=0.0)  # Nesterov needs momentum: plain SGD
    with torch.no_grad():
        p.fill_(0.8)
    assert d.step() is True and p.item() == pytest.approx(0.8), "the start moves all the way: the average"
    for lr, momentum in ((0.0, 0.9), (-1.0, 0.9), (11.0, 0.9), (0.7, 1.0), (0.7, -0.1), (float("nan"), 0.9)):
        with pytest.raises(ValueError, match="outer_lr"):
            train.DiLoCo([p], every=1, outer_lr=lr, outer_momentum=momentum)


def test_training_that_ends_mid_round_takes_that_rounds_outer_step():
    p = nn.Parameter(torch.tensor([1.0]))
    d = train.DiLoCo([p], every=4, **PAPER)
    assert d.finish() is False, "nothing taken since the last outer step"
    with torch.no_grad():
        p.fill_(0.8)
    d.step()
    assert d.finish() is True and p.item() == pytest.approx(0.734) and d.rounds == 1 and d.steps == 4
    assert d.finish() is False


def test_a_resumed_diloco_keeps_the_outer_momentum_and_restarts_the_round():
    p = nn.Parameter(torch.tensor([1.0]))
    d = train.DiLoCo([p], every=2, **PAPER)
    with torch.no_grad():
        p.fill_(0.8)
    d.step(), d.step()
    with torch.no_grad():
        p.fill_(0.5)  # an inner step into the next round, then the crash
    d.step()
    state = d.state_dict()

    q = nn.Parameter(torch.tensor([123.0]))
    resumed = train.DiLoCo([q], every=2, **PAPER)
    resumed.load_state_dict(state)
    assert q.item() == pytest.approx(0.734), "from the round's start: the crashed round's inner steps are redone"
    assert resumed.rounds == 1 and resumed.steps == 2, "no outer step lost"
    with torch.no_grad():
        q.fill_(0.634)
    resumed.step(), resumed.step()
    assert q.item() == pytest.approx(0.4876), "the momentum came along"
    with pytest.raises(ValueError, match="another model"):
        train.DiLoCo([nn.Parameter(torch.zeros(2))], every=2).load_state_dict(state)


@pytest.mark.parametrize("text, want", [("ddp", sync.Spec("ddp")), ("local:8", sync.Spec("local", 8)),
                                        ("diloco:500", sync.Spec("diloco", 500))])
def test_specs(text, want):
    assert train.parse(text) == want


@pytest.mark.parametrize("text", ["", "DDP", "local", "local:0", "diloco:-3", "diloco:1e3", "diloco:10000000",
                                  "local:8 ", "fedavg:8", "diloco:08"])
def test_a_bad_spec_names_what_is_expected(text):
    with pytest.raises(ValueError, match="expected ddp, local:H or diloco:H"):
        train.parse(text)


def test_the_layout_from_the_environment():
    env = {"GROUP_WORLD_SIZE": "3", "GROUP_RANK": "2", "LOCAL_WORLD_SIZE": "2", "SWARM_GROUPS": "0,2;1"}
    where = train.layout(env)
    assert where.groups == ((0, 2), (1,)) and where.group == 0
    assert where.ranks(0) == [0, 1, 4, 5] and where.ranks(1) == [2, 3]
    assert train.layout({}).groups == ((0,),), "no swarm: one node, one group"
    assert train.layout({"GROUP_WORLD_SIZE": "2"}).groups == ((0, 1),)


@pytest.mark.parametrize("env, says", [
    ({"SWARM_GROUPS": "0,1;"}, "SWARM_GROUPS"),
    ({"SWARM_GROUPS": "0,1;1"}, "exactly once"),
    ({"SWARM_GROUPS": "0"}, "exactly once"),
    ({"SWARM_GROUPS": "0,1,2"}, "exactly once"),
    ({"SWARM_GROUPS": "0;1\n"}, "SWARM_GROUPS"),
    ({"SWARM_GROUPS": "\x1b[31m0;1"}, "SWARM_GROUPS"),
    ({"SWARM_GROUPS": ",".join(["0"] * 40000)}, "SWARM_GROUPS"),
    ({"GROUP_RANK": "2"}, "not below GROUP_WORLD_SIZE"),
    ({"GROUP_RANK": "-1"}, "GROUP_RANK"),
    ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE"),
    ({"GROUP_WORLD_SIZE": "99999999999"}, "GROUP_WORLD_SIZE"),
])
def test_a_malformed_environment_is_a_clear_error_in_the_rank(env, says):
    with pytest.raises(EnvError, match=says):
        train.layout({"GROUP_WORLD_SIZE": "2", "GROUP_RANK": "0", **env})


def test_the_mode_follows_the_spec_and_the_groups():
    one = {"GROUP_WORLD_SIZE": "2", "GROUP_RANK": "0"}
    assert train.plan("ddp", env=one).mode == "ddp"
    assert train.plan("diloco:8", env=one).mode == "flat"
    near = train.plan("diloco:8", env={**one, "SWARM_GROUPS": "0,1"})
    assert near.mode == "ddp" and "ddp every step" in near.describe(), "all near: nothing is slow to sync over"
    with pytest.raises(ValueError, match="compression"):
        train.plan("diloco:8", compression="zip", env=one)


def _everyones(model, world) -> list[torch.Tensor]:
    """Every rank's parameters, flat, in rank order (a collective: every rank calls it)."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return gathered


def _one_model(model, world) -> bool:
    gathered = _everyones(model, world)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _train(rank, world):
    """diloco:4 on 3 ranks, each its own data: after every round the models agree."""
    torch.manual_seed(rank)  # different initial weights: DiLoCo starts every rank from rank 0's
    model = nn.Linear(8, 2)
    plan = train.plan("diloco:4", compression="int8")
    net = plan.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 8), torch.randn(64, 2)
    losses, synced, agree = [], [], []
    for step in range(12):
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        if plan.step():
            synced.append(step)
            agree.append(_one_model(model, world))
        losses.append(loss.item())
    return {"mode": plan.mode, "synced": synced, "agree": agree, "sent": plan.diloco.sent, "losses": losses,
            "rounds": plan.rounds}


def test_three_ranks_agree_after_every_outer_step(tmp_path):
    results = run(_train, 3, tmp_path, env_of=lambda r: {"GROUP_WORLD_SIZE": "3", "GROUP_RANK": str(r),
                                                          "LOCAL_WORLD_SIZE": "1"})
    for r in results:
        assert r["mode"] == "flat" and r["synced"] == [3, 7, 11] and r["rounds"] == 3 and all(r["agree"]), r
        assert r["losses"][-1] < r["losses"][0]
        fp32 = 3 * train.compress.wire_bytes(18, "fp32", 3)
        assert 0 < r["sent"] < fp32 / 2, "int8: under half what three fp32 ring all-reduces of 18 values send"


def _hierarchical(rank, world):
    torch.manual_seed(rank)
    model = nn.Linear(4, 1)
    plan = train.plan("local:3")
    net = plan.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 4) + rank, torch.randn(16, 1)
    seen = []
    for _ in range(5):
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        plan.step()
        gathered = _everyones(model, world)
        seen.append([torch.equal(gathered[i], gathered[j]) for i, j in ((0, 2), (1, 3), (0, 1))])
    plan.finish()
    return {"mode": plan.mode, "seen": seen, "describe": plan.describe(), "syncs": plan.syncs,
            "one_model": _one_model(model, world)}


def test_hierarchical_groups_agree_every_step_and_all_ranks_every_h(tmp_path):
    """Four single-rank nodes in groups {0, 2} and {1, 3}: DDP keeps each group together every
    step; averaging every 3 steps (torch's averager: its first step, then every third) brings all
    four together after steps 1 and 4, and they part in between."""
    env = {"GROUP_WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1", "SWARM_GROUPS": "0,2;1,3"}
    results = run(_hierarchical, 4, tmp_path, env_of=lambda r: {**env, "GROUP_RANK": str(r)})
    seen = results[0]["seen"]
    assert results[0]["mode"] == "hierarchical" and "inside each group" in results[0]["describe"]
    assert all(s[0] and s[1] for s in seen), "each group together every step"
    assert [s[2] for s in seen] == [True, False, False, True, False], "all together right after each sync"
    assert results[0]["one_model"] and results[0]["syncs"] == 3, "finish: one more averaging, one model"


# --- Streaming DiLoCo: fragments in turn, overlapped -----------------------------------------

def test_fragments_are_runs_of_about_equal_size():
    ps = [nn.Parameter(torch.zeros(n)) for n in (100, 10, 10, 100, 5, 200)]
    assert sync.split(ps, 1) == [[0, 1, 2, 3, 4, 5]]
    assert sync.split(ps, 2) == [[0, 1, 2, 3], [4, 5]], "220 and 205 of 425 values"
    assert sync.split(ps, 3) == [[0, 1, 2], [3, 4], [5]]
    assert sync.split(ps, 9) == [[i] for i in range(6)], "never more fragments than tensors, none empty"


def test_each_fragment_takes_its_outer_step_at_its_turn_with_its_own_momentum():
    """Two parameters, two fragments, H = 4: fragment 0 syncs at steps 2, 6, ...; fragment 1 at
    4, 8, ... (the step a round without fragments syncs at). Each fragment's outer step is the
    hand-computed one of its own outer gradient; the other stays where its inner steps took it."""
    a, b = nn.Parameter(torch.tensor([1.0])), nn.Parameter(torch.tensor([1.0]))
    d = train.DiLoCo([a, b], every=4, fragments=2, **PAPER)
    assert d.turns == [2, 0] and d.fragments == [[0], [1]]
    with torch.no_grad():
        a.fill_(0.8), b.fill_(0.9)
    assert d.step() is False and d.step() is True, "fragment 0's turn at step 2"
    assert a.item() == pytest.approx(0.734) and b.item() == pytest.approx(0.9) and d.rounds == 0
    with torch.no_grad():
        b.fill_(0.8)
    assert d.step() is False and d.step() is True and b.item() == pytest.approx(0.734) and d.rounds == 1
    with torch.no_grad():
        a.fill_(0.634)
    d.step(), d.step()
    assert a.item() == pytest.approx(0.4876), "fragment 0's second outer step: its momentum, not b's"
    assert d.finish() is True and d.finish() is False, "fragment 1 had two steps since its turn; then neither"


def test_an_overlapped_sync_lands_delay_steps_later_and_mixes():
    """delay 1: the outer gradient is taken at the fragment's turn, the outer step lands one
    inner step later, and the parameter is mixed half and half with where it went meanwhile."""
    p = nn.Parameter(torch.tensor([1.0]))
    d = train.DiLoCo([p], every=2, delay=1, **PAPER)
    with torch.no_grad():
        p.fill_(0.8)
    d.step()
    assert d.step() is False and p.item() == pytest.approx(0.8), "started at step 2, not landed"
    with torch.no_grad():
        p.fill_(0.7)  # the inner step that ran while the bytes travelled
    assert d.step() is True and d.start[0].item() == pytest.approx(0.734), "the outer gradient of step 2: 0.2"
    assert p.item() == pytest.approx(0.5 * 0.7 + 0.5 * 0.734)
    assert d.finish() is True and p.item() == pytest.approx(d.start[0].item()), "finish: one model again"


@pytest.mark.parametrize("kwargs", [{"fragments": 0}, {"fragments": 5}, {"delay": -1}, {"fragments": 2, "delay": 2},
                                    {"fragments": 2.0}, {"delay": 0.5}])
def test_bad_fragments_or_delay_are_refused(kwargs):
    with pytest.raises(ValueError, match="fragments"):
        train.DiLoCo([nn.Parameter(torch.zeros(1))], every=4, **kwargs)
    with pytest.raises(ValueError, match="fragments"):
        train.plan("diloco:4", env={"GROUP_WORLD_SIZE": "1", "GROUP_RANK": "0"}, **kwargs)
    with pytest.raises(ValueError, match="Streaming DiLoCo"):
        train.plan("local:4", fragments=2, env={"GROUP_WORLD_SIZE": "1", "GROUP_RANK": "0"})


def _stream(rank, world):
    """diloco:8 in 4 fragments, each overlapped with one step, on 3 ranks: the loss falls, each
    sync sends a quarter of the model, and finish leaves one model."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    plan = train.plan("diloco:8", compression="fp16", fragments=4, delay=1)
    net = plan.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 8), torch.randn(64, 2)
    losses, landed = [], []
    for step in range(24):
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        if plan.step():
            landed.append(step + 1)
        losses.append(loss.item())
    plan.finish()
    return {"landed": landed, "losses": losses, "sent": plan.diloco.sent, "syncs": plan.diloco.syncs,
            "describe": plan.describe(), "one_model": _one_model(model, world)}


def test_streaming_diloco_on_three_ranks(tmp_path):
    results = run(_stream, 3, tmp_path, env_of=lambda r: {"GROUP_WORLD_SIZE": "3", "GROUP_RANK": str(r),
                                                           "LOCAL_WORLD_SIZE": "1"})
    for r in results:
        assert r["landed"] == [3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23], "a fragment every 2 steps, 1 step late"
        assert r["one_model"] and r["losses"][-1] < r["losses"][0] and "4 fragments" in r["describe"], r
        whole = train.compress.wire_bytes(8 * 16 + 16 + 16 * 2 + 2, "fp16", 3)
        assert r["sent"] <= (r["syncs"] / 4) * whole * 1.1, "a sync sends about a quarter of the model"

"""A job's hosts under a hand-over (issue 26), over the real handler and worker: the ranks of a
job whose coordinator went away wait for a successor, which attaches at its epoch and gets
every line of the attempt once, the ranks untouched; the old coordinator is fenced off; and
what a misbehaving member sends (a forged charter, an epoch not its own, a stale one, a job
it does not hold) is refused, counted and answered with the reason."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
import trio

from compute.test_succession import PEER, body_of, forged, sign
from fake_stream import FakeStream
from swarmd.compute.succession import Charter, spec_digest
from test_job_protocol import JOB, Host, req, start_body

O, S, H, X = PEER["o"], PEER["h2"], PEER["h3"], PEER["x"]

RANK = """
import os, sys, time
from pathlib import Path
flag = Path(sys.argv[1])
for i in range(5):
    print("before", i, "pid", os.getpid(), flush=True)
while not flag.exists():
    time.sleep(0.02)
for i in range(5):
    print("after", i, "pid", os.getpid(), flush=True)
"""


def the_charter(job: str = JOB, signer: str = "o") -> Charter:
    return Charter.make(origin=O, job=job, owner_uid=1000, spec=spec_digest({"cmd": ["x"]}), hosts=[S, H],
                        sign=sign(signer))


class Breaking(FakeStream):
    """The origin's job stream: its writes fail once `broken` (the origin crashed)."""

    broken = False

    async def write(self, data: bytes) -> None:
        if self.broken:
            raise ConnectionResetError("the origin is gone")
        await super().write(data)


def lines_of(replies: list) -> list[str]:
    return [text for r in replies if "out" in r for _, text in r["out"]]


def a_host(tmp_path: Path) -> Host:
    host = Host(tmp_path)
    host.worker.user = "nobody" if os.geteuid() == 0 else None  # as a daemon's job user
    return host


def a_flag() -> Path:
    """Where the test tells the rank (as the job user) to go on: somewhere it can look."""
    return Path("/tmp") / f"swarmd-test-flag-{uuid.uuid4().hex}"


async def started_under(host: Host, charter: Charter, flag: Path, nursery: trio.Nursery) -> Breaking:
    """The origin reserves, commits and starts one rank of the job on `host`, with its charter."""
    claim = {"origin": O, "epoch": 0, "charter": charter.blob}
    assert await host.ask(O, req("reserve", gpus=0, ranks=1, lease=30.0)) == [{"gpus": []}]
    assert await host.ask(O, req("commit", **claim)) == [{"gpus": []}]
    body = start_body() | {"cmd": [sys.executable, "-c", RANK, str(flag)]}
    stream = Breaking(O, [req("start", **claim), body], hang=True)
    nursery.start_soon(host.handler.handle, stream)
    with trio.fail_after(30):
        while len([t for t in lines_of(stream.replies()) if t.startswith("before")]) < 5:
            assert not any("error" in r for r in stream.replies()), stream.replies()
            await trio.sleep(0.02)
    return stream


async def test_a_successor_attaches_and_gets_every_line_once_the_ranks_untouched_the_origin_fenced(tmp_path):
    host, charter, flag = a_host(tmp_path), the_charter(), a_flag()
    async with trio.open_nursery() as nursery:
        origin = await started_under(host, charter, flag, nursery)
        origin.broken = True  # the origin crashed: the next heartbeat finds its stream broken
        with trio.fail_after(10):
            while host.worker.sinks[(O, JOB)].orphaned is None:
                await trio.sleep(0.02)
        told = len(origin.replies())
        successor = FakeStream(S, [req("attach", origin=O, epoch=1, charter=charter.blob)], hang=True)
        nursery.start_soon(host.handler.handle, successor)
        with trio.fail_after(10):
            while not successor.replies():
                await trio.sleep(0.02)
        flag.touch()
        with trio.fail_after(30):
            while not successor.replies() or successor.replies()[-1] != {"done": True}:
                await trio.sleep(0.05)
        got = successor.replies()
        assert "attached" in got[0] and got[0]["attached"]["ranks"] == [0], got[0]
        lines = lines_of(got)
        pids = {t.split()[-1] for t in lines}
        assert [t.rsplit(" pid", 1)[0] for t in lines] == [f"before {i}" for i in range(5)] + \
            [f"after {i}" for i in range(5)], "every line of the attempt once, in order"
        assert len(pids) == 1, "the rank was never restarted"
        assert [r for r in got if "exit" in r][0]["exit"] == [[0, 0]]
        assert len(origin.replies()) == told, "nothing more went to the gone origin"
        flag.unlink()
        # the origin comes back at its old epoch: fenced off, counted
        answer = await host.ask(O, req("cancel", origin=O, epoch=0))
        assert "successor took it over" in answer[0]["error"] and host.rejected["stale_epoch"] == 1
        nursery.cancel_scope.cancel()


async def test_ranks_whose_coordinator_has_no_successor_stop_as_before(tmp_path):
    host, flag = a_host(tmp_path), a_flag()
    async with trio.open_nursery() as nursery:
        lone = Charter.make(origin=O, job=JOB, owner_uid=1, spec="ab" * 32, hosts=[O], sign=sign("o"))
        origin = await started_under(host, lone, flag, nursery)
        origin.broken = True
        with trio.fail_after(20):
            while host.worker.running:
                await trio.sleep(0.05)
        assert (O, JOB) not in host.worker.sinks and host.worker.ledger.slots_free == 2
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("peer, claim, reason", [
    (X, {"origin": O, "epoch": 1}, "not_coordinator"),  # no charter: only the origin commands
    (X, {"origin": O, "epoch": 1, "charter": "charter"}, "not_replica"),
    (H, {"origin": O, "epoch": 1, "charter": "charter"}, "not_its_epoch"),  # epoch 1 is S's
    (S, {"origin": O, "epoch": 1, "charter": "forged"}, "signature"),
    (S, {"origin": O, "epoch": 1, "charter": "other_job"}, "charter_mismatch"),
    (S, {"origin": "not a peer id", "epoch": 1}, "charter"),
    (S, {"origin": O, "epoch": -1}, "bad_epoch"),
    (S, {"origin": O, "epoch": 2**40}, "bad_epoch"),
    (S, {"origin": O, "epoch": True}, "bad_epoch"),
    (S, {"origin": O, "epoch": "1"}, "bad_epoch"),
])
@pytest.mark.parametrize("op", ["attach", "cancel", "release", "reserve"])
async def test_a_member_that_may_not_command_the_job_is_refused_and_counted(tmp_path, peer, claim, reason, op):
    host = Host(tmp_path)
    assert await host.ask(O, req("reserve", gpus=0, ranks=1, lease=30.0)) == [{"gpus": []}]
    blobs = {"charter": the_charter().blob, "forged": forged(body_of(the_charter()), by="x"),
             "other_job": the_charter(job="0123456789ac").blob}
    if "charter" in claim:
        claim = claim | {"charter": blobs[claim["charter"]]}
    replies = await host.ask(peer, req(op, gpus=0, ranks=1, lease=30.0, **claim))
    assert len(replies) == 1 and "error" in replies[0], replies
    assert host.rejected[reason] == 1, host.rejected
    assert host.worker.ledger.state_of(JOB, O) == "leased", "the origin's hold is untouched"


async def test_a_fence_that_remembers_too_many_jobs_forgets_those_without_a_hold(tmp_path):
    host = Host(tmp_path)
    host.worker.fence.max_jobs = 4
    for i in range(12):  # a member minting charters of its own: each admitted, none piling up
        job = f"0123456789{i:02d}"
        mine = Charter.make(origin=X, job=job, owner_uid=1, spec="ab" * 32, hosts=[X], sign=sign("x"))
        replies = await host.ask(X, req("release", job=job, origin=X, epoch=0, charter=mine.blob))
        assert "error" in replies[0] or replies == [{}]
    assert len(host.worker.fence._seen) <= 4

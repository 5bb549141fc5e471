"""The torchrun anchor's reading of torchrun's output (the lab run itself is `python -m bench.elastic_torchrun`)."""

from bench.elastic_torchrun import parse


def test_steps_worker_starts_and_everything_else_are_told_apart():
    out = parse("start rank 0 world 3 restart 0 100.5\nstep 1 101.0\n"
                "WARNING:torch.distributed.elastic.agent.server.api:Worker group FAILED\n"
                "step 2 101.1\nstep x y\n\nstart rank 1 world 2 restart 1 130.25\nstep 1 131.0\n")
    assert out["steps"] == [101.0, 101.1, 131.0]
    assert out["starts"] == [(0, 100.5), (1, 130.25)] and out["worlds"] == [3, 2]
    assert out["other"] == ["WARNING:torch.distributed.elastic.agent.server.api:Worker group FAILED", "step x y"]

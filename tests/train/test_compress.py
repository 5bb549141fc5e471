"""What goes on the wire when ranks average (swarmd/train/compress.py)."""

import math

import pytest
import torch

from swarmd.train import compress

from .ranks import run


def test_int8_round_trip_is_within_half_a_step_of_each_blocks_scale():
    torch.manual_seed(0)
    flat = torch.randn(3 * compress.BLOCK + 17) * torch.logspace(-4, 1, 3 * compress.BLOCK + 17)
    q, scale = compress.pack_int8(flat)
    assert q.dtype == torch.int8 and q.numel() == 4 * compress.BLOCK and scale.numel() == 4
    back = compress.unpack_int8(q, scale, flat.numel())
    per_value = scale.repeat_interleave(compress.BLOCK)[:flat.numel()]
    assert torch.all((back - flat).abs() <= per_value / 2 + 1e-7)
    # an outlier costs its own block's precision only
    flat = torch.full((2 * compress.BLOCK,), 1e-3)
    flat[0] = 100.0
    back = compress.unpack_int8(*compress.pack_int8(flat), flat.numel())
    assert torch.allclose(back[compress.BLOCK:], flat[compress.BLOCK:], rtol=1e-2)


def test_int8_of_zeros_nans_and_infinities_is_finite():
    flat = torch.tensor([0.0, math.nan, math.inf, -math.inf, 0.5])
    back = compress.unpack_int8(*compress.pack_int8(flat), flat.numel())
    assert torch.isfinite(back).all() and back[0] == 0 and abs(back[4] - 0.5) < 0.01
    zeros = torch.zeros(10)
    assert torch.equal(compress.unpack_int8(*compress.pack_int8(zeros), 10), zeros)


def test_flatten_and_unflatten_keep_shapes_and_dtypes():
    tensors = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.randn(2, 2, 2)]
    flat = compress.flatten(tensors)
    assert flat.dtype == torch.float32 and flat.numel() == 12 + 5 + 8
    out = [torch.zeros_like(t) for t in tensors]
    compress.unflatten_into(flat, out)
    assert all(torch.allclose(a.float(), b.float()) for a, b in zip(out, tensors))
    assert out[1].dtype == torch.bfloat16


def test_int8_sends_less_than_fp32_up_to_seven_ranks():
    n = 1_000_000
    for world in range(2, 8):
        assert compress.wire_bytes(n, "int8", world) < compress.wire_bytes(n, "fp32", world), world
        assert abs(compress.wire_bytes(n, "fp16", world) * 2 - compress.wire_bytes(n, "fp32", world)) <= 2
    assert compress.wire_bytes(n, "int8", 1) == 0
    with pytest.raises(ValueError, match="compression must be one of"):
        compress.check_kind("int4")


def _average(rank, world):
    torch.manual_seed(rank)
    base = [torch.randn(1000) * 1e-2, torch.randn(7, 3) * 1e-2]
    out = {}
    for kind in compress.KINDS:
        tensors = [t.clone() for t in base]
        sent = compress.average_(tensors, kind)
        out[kind] = ([t.clone() for t in tensors], sent)
    return base, out


def test_three_ranks_get_one_identical_average_in_every_kind(tmp_path):
    results = run(_average, 3, tmp_path)
    truth = [sum(r[0][i] for r in results) / 3 for i in range(2)]
    for kind, tol in (("fp32", 1e-7), ("fp16", 1e-5), ("int8", 2e-4)):
        first = results[0][1][kind][0]
        for _, out in results:
            assert all(torch.equal(a, b) for a, b in zip(out[kind][0], first)), f"{kind}: ranks differ"
        assert all(torch.allclose(a, t, atol=tol) for a, t in zip(first, truth)), kind
        assert results[0][1][kind][1] == compress.wire_bytes(1021, kind, 3)
    assert results[0][1]["int8"][1] < results[0][1]["fp32"][1]


def test_one_process_without_a_group_averages_to_itself():
    tensors = [torch.ones(3)]
    assert compress.average_(tensors, "int8") == 0 and torch.equal(tensors[0], torch.ones(3))

"""Averaging a list of tensors over a process group, sent as fp32, fp16 or int8.

What DiLoCo sends across slow links is the outer gradient (the pseudo-gradient: where the
model started the round minus where this rank's inner steps took it). INTELLECT-1 sends it
as int8 (400× less than data parallel, with the 100× from syncing rarely), DiLoCo's paper
as fp16 without loss. Here:

- ``fp32``: ``all_reduce`` (SUM), then divided: the reference;
- ``fp16``: the same in half precision (values are clamped to fp16's range first: a
  pseudo-gradient is a small difference of weights, so the clamp never bites an honest one);
- ``int8``: each block of ``BLOCK`` values is scaled by its own largest magnitude (absmax:
  one outlier costs its block's precision, not the tensor's) and rounded to int8; ranks
  ``all_gather`` the int8 blocks and their fp32 scales and each averages the dequantised
  copies itself. A ring all-reduce cannot sum int8 without overflow or a requantise per hop,
  so this is a gather: per rank it sends its 1-byte values to all others, (n - 1) bytes per
  value, against about 8 (n - 1) / n for fp32's ring all-reduce: less for up to 7 ranks,
  where DiLoCo runs (a rank or a few per region).

Every rank gets the identical average (each computes it from the same gathered bytes in the
same order), so the models stay in step. ``pack``/``unpack`` are the sans-IO halves.
``start_average`` issues the collectives and returns at once (Streaming DiLoCo's overlap: the
next inner steps run while the bytes travel); ``average_`` waits for them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

KINDS = ("fp32", "fp16", "int8")
BLOCK = 1024
FP16_MAX = 65504.0


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"compression must be one of {', '.join(KINDS)}, not {kind!r}")
    return kind


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One fp32 vector of all the tensors, in order."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors]) if tensors else torch.zeros(0)


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` (their shapes, dtypes and devices)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t).to(t.dtype))
        offset += n


def block_size(numel: int) -> int:
    """Values per scale: ``BLOCK``, or all of them when fewer (a small tensor is not padded out)."""
    return max(1, min(BLOCK, numel))


def pack_int8(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values padded to whole blocks, one fp32 scale per block): value = q * scale."""
    block = block_size(flat.numel())
    blocks = -(-flat.numel() // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=flat.device)
    padded[:flat.numel()] = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0)
    padded = padded.view(blocks, block)
    scale = padded.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(padded / safe[:, None]), -127, 127).to(torch.int8)
    return q.view(-1), scale


def unpack_int8(q: torch.Tensor, scale: torch.Tensor, numel: int) -> torch.Tensor:
    return (q.view(scale.numel(), -1).to(torch.float32) * scale[:, None]).view(-1)[:numel]


def wire_bytes(numel: int, kind: str, world: int) -> int:
    """Bytes one rank sends to average ``numel`` values over ``world`` ranks (the ring's
    2 (n - 1) / n of the payload for an all-reduce; (n - 1) copies for a gather)."""
    if world <= 1:
        return 0
    if kind == "int8":
        block = block_size(numel)
        blocks = -(-numel // block)
        return (world - 1) * (blocks * block + 4 * blocks)
    size = 4 if kind == "fp32" else 2
    return int(2 * (world - 1) / world * numel * size)


class Pending:
    """An average under way (``start_average``): ``wait()`` writes it into the tensors. Every
    collective is issued at the start, in the same order on every rank, so ranks may wait at
    different moments; the result is the same on each."""

    def __init__(self, tensors: list[torch.Tensor], kind: str, world: int, flat: torch.Tensor,
                 works: list[Any], gathered: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
                 half: torch.Tensor | None = None) -> None:
        self.tensors, self.kind, self.world, self.flat = tensors, kind, world, flat
        self._works, self._gathered, self._half = works, gathered, half
        self.sent = wire_bytes(sum(t.numel() for t in tensors), kind, world) if world > 1 else 0
        self.done = not works

    def wait(self) -> None:
        if self.done:
            return
        for work in self._works:
            work.wait()
        flat = self.flat
        if self.kind == "fp32":
            flat = flat / self.world
        elif self.kind == "fp16":
            flat = self._half.to(torch.float32) / self.world
        else:
            qs, scales = self._gathered
            total = torch.zeros(qs[0].numel(), dtype=torch.float32, device=flat.device)
            for q_r, s_r in zip(qs, scales):  # rank order: every rank sums in the same order
                total += unpack_int8(q_r, s_r, q_r.numel())
            flat = total[:flat.numel()] / self.world
        unflatten_into(flat, self.tensors)
        self.done = True


def start_average(tensors: list[torch.Tensor], kind: str = "fp32", group: dist.ProcessGroup | None = None) -> Pending:
    """Begin replacing each tensor by its average over ``group`` (asynchronous collectives; the
    tensors are read now and written at ``wait()``)."""
    check_kind(kind)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    flat = flatten(tensors)
    if world <= 1 or not tensors:
        return Pending(tensors, kind, world, flat, [])
    if kind == "fp32":
        return Pending(tensors, kind, world, flat, [dist.all_reduce(flat, group=group, async_op=True)])
    if kind == "fp16":
        half = torch.clamp(torch.nan_to_num(flat), -FP16_MAX / world, FP16_MAX / world).to(torch.float16)
        return Pending(tensors, kind, world, flat, [dist.all_reduce(half, group=group, async_op=True)], half=half)
    q, scale = pack_int8(flat)
    qs = [torch.empty_like(q) for _ in range(world)]
    scales = [torch.empty_like(scale) for _ in range(world)]
    works = [dist.all_gather(qs, q, group=group, async_op=True), dist.all_gather(scales, scale, group=group,
                                                                                  async_op=True)]
    return Pending(tensors, kind, world, flat, works, gathered=(qs, scales))


def average_(tensors: list[torch.Tensor], kind: str = "fp32", group: dist.ProcessGroup | None = None) -> int:
    """Replace each tensor by its average over ``group``; returns the bytes this rank sent."""
    pending = start_average(tensors, kind, group)
    pending.wait()
    return pending.sent

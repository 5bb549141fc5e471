"""A nursery's lone error comes out as itself, so the coordinator and the host handle a
HostError or a Superseded by its type (the coordinator once failed a job with "coordinator
error: ExceptionGroup: Exceptions from Trio nursery (1 sub-exception)", naming nothing)."""

from __future__ import annotations

import pytest
import trio

from swarmd.compute.coordinator.hosts import HostError
from swarmd.compute.nursery import leaves, lone_error


async def _raise(exc: BaseException) -> None:
    raise exc


async def test_a_lone_error_comes_out_as_itself():
    with pytest.raises(HostError, match="stream closed"):
        async with lone_error(), trio.open_nursery() as nursery:
            nursery.start_soon(_raise, HostError("AAAAaaaa: stream closed"))
            await trio.sleep_forever()


async def test_a_lone_error_in_nested_nurseries_comes_out_as_itself():
    async def inner() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(_raise, ValueError("deep"))

    with pytest.raises(ValueError, match="deep"):
        async with lone_error(), trio.open_nursery() as nursery:
            nursery.start_soon(inner)


async def test_two_errors_stay_a_group():
    with pytest.raises(BaseExceptionGroup) as caught:
        async with lone_error(), trio.open_nursery() as nursery:
            nursery.start_soon(_raise, ValueError("one"))
            nursery.start_soon(_raise, KeyError("two"))
    assert sorted(type(e).__name__ for e in leaves(caught.value)) == ["KeyError", "ValueError"]


def test_leaves_walks_a_deep_group_without_recursion():
    group: BaseExceptionGroup = ExceptionGroup("leaf", [ValueError(0)])
    for depth in range(1, 5000):  # deeper than Python's recursion limit
        group = ExceptionGroup("level", [group, ValueError(depth)]) if depth % 1000 == 0 else \
            ExceptionGroup("level", [group])
    assert [e.args[0] for e in leaves(group)] == [0, 1000, 2000, 3000, 4000]

"""A nursery's lone error as itself (trio wraps whatever a nursery's tasks raise in an
ExceptionGroup): so a caller handles an ExecutorError, a coordinator's stream breaking, a
HostError or a Superseded by its type. More than one error, or a cancellation, stays a group."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator


@contextlib.asynccontextmanager
async def lone_error() -> AsyncIterator[None]:
    try:
        yield
    except BaseExceptionGroup as group:
        found = list(leaves(group))
        if len(found) == 1 and isinstance(found[0], Exception):
            raise found[0] from None
        raise


def leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    """Every exception in ``group``, nested groups opened (iteratively: a group is a tree a
    task shaped)."""
    stack = list(reversed(group.exceptions))
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(reversed(exc.exceptions))
        else:
            yield exc

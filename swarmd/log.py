"""Logging: structlog everywhere, JSON lines for journald, readable lines on a TTY.

The standard library's loggers (libp2p's among them) are routed through the same
processors, so one line format covers the daemon and its libraries. Context such as the
peer id is bound with ``structlog.contextvars`` and appears on every line.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

QUIET_LIBRARIES = ("libp2p", "multiaddr")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    stream = stream or sys.stderr
    console = fmt == "console" or (fmt == "auto" and stream.isatty())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer(colors=stream.isatty()) if console
        else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *([] if console else [structlog.processors.format_exc_info]), renderer]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)
    # Importing libp2p turns off propagation of its logger (DESIGN): turn it back on so
    # its records reach the handler above. Its and multiaddr's per-packet debug chatter
    # would drown ours, so they speak from warning up.
    for name in QUIET_LIBRARIES:
        lib = logging.getLogger(name)
        lib.propagate = True
        lib.handlers[:] = []
        lib.setLevel(logging.WARNING)


def set_level(level: str) -> None:
    logging.getLogger().setLevel(_LEVELS[level])

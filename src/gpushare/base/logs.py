"""structlog set-up: JSON lines in the DaemonSet, readable columns on a terminal."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def processors(renderer: structlog.types.Processor) -> list[structlog.types.Processor]:
    """The daemon's processor chain (context, level, UTC time, exception) ending in
    ``renderer``; the tests configure their process with the same chain."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        renderer,
    ]


def configure_logging(fmt: str = "auto", level: str = "info", stream: TextIO | None = None) -> None:
    """Configure structlog once per process. ``fmt`` is json, console or auto."""
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=processors(renderer),
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )

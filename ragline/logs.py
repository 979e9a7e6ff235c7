"""structlog setup: one line per event, with job ids bound where known."""

from __future__ import annotations

import logging

import structlog


def configure(level: str = "INFO", json: bool = False) -> None:
    logging.basicConfig(level=level.upper(), format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
    )

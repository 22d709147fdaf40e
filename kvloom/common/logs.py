"""One log format for every kvloom process: time, level, component, message."""

from __future__ import annotations

import contextlib
import logging
import sys


def setup_logging(level: str, component: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)-7s {component} %(name)s: %(message)s",
            datefmt="%Y-%m-%dT%H:%M:%S",
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # grpc's own logger is chatty at INFO about channel state.
    logging.getLogger("grpc").setLevel(logging.WARNING)


def flush_log_handlers() -> None:
    """Flush every root handler before os._exit (which skips it). A handler
    whose stream is already closed must not stop the exit."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(OSError, ValueError):
            handler.flush()

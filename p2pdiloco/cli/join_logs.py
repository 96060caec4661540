"""Where ``join``'s log lines go: JSON objects (``--json-logs``), or a file next to the state
while the dashboard owns the terminal."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path


class _JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj)


def json_logging() -> None:
    """``join --json-logs``: every log line is one JSON object."""
    root = logging.getLogger()
    for h in root.handlers:
        h.setFormatter(_JSONFormatter())


def log_to_file(path: Path) -> None:
    """While the dashboard owns the terminal, log lines go to a file next to the state."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    logging.raiseExceptions = False  # a full disk must not print a traceback per log line
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            with contextlib.suppress(Exception):
                root.removeHandler(h)
    root.addHandler(handler)

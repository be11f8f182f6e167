"""Log output: readable lines by default, JSON lines with `--log-format json`.

A JSON line holds ts (UTC, ISO 8601, milliseconds), level, logger and msg, and
`request_id` (and `peer`) when the log call passes one through `extra=`, e.g.
`log.warning("...", extra={"request_id": rid})`. Request ids belong in logs;
they never become metric labels.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Fields a log call may attach with `extra=` that are copied into JSON lines.
_EXTRA_FIELDS = ("request_id", "peer")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _EXTRA_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger once, on stderr (journald and containers collect it)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    set_level(level)


def set_level(level: str) -> None:
    """Change the least severe level emitted (used at start-up and by a reload)."""
    logging.getLogger().setLevel(getattr(logging, level, logging.INFO))

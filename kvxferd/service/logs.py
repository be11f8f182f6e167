"""Log output: readable lines by default, JSON lines with `--log-format json`.

A JSON line holds ts (UTC, ISO 8601, milliseconds), level, logger and msg, and
`request_id` (and `peer`) when the log call passes one through `extra=`, e.g.
`log.warning("...", extra={"request_id": rid})`. Request ids belong in logs;
they never become metric labels.

Strings from a peer daemon or an engine (request ids, pool ids, reasons, messages, and
exception texts built from them) reach a log line only through `shown`: escaped, so a
newline cannot forge a line, and truncated, so a megabyte id cannot flood the log. Both
formatters bound every message once more as a backstop. A failure an outside source can
repeat at will is logged through a `LogLimiter`, keyed by that source.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from datetime import datetime, timezone

FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Fields a log call may attach with `extra=` that are copied into JSON lines.
_EXTRA_FIELDS = ("request_id", "peer")

# A value (an id, a name) in a log line: the 128-character daemon names and vLLM's
# request ids fit whole.
SHOWN_LIMIT = 128
# A free text (a peer's message, an exception text that may quote one).
TEXT_LIMIT = 1024
# The backstop: no message of a formatted line is longer, whatever a call site passed.
MESSAGE_LIMIT = 16 << 10


def shown(value: object, limit: int = SHOWN_LIMIT, quote: bool = True) -> str:
    """`value` (from a peer or an engine) as it may appear in a log line: at most `limit`
    characters of it, with every character that is not printable escaped (no newline,
    carriage return, escape sequence or Unicode line separator gets through), and the full
    length named when it was cut. A str is quoted (repr) unless `quote` is False (a free
    text such as a peer's message); any other value (an exception, a number) is shown as
    its str(), escaped the same way but not quoted; bytes as their repr."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        size = len(value)
        text = repr(bytes(value[:limit]))
    else:
        quote = quote and isinstance(value, str)
        raw = value if isinstance(value, str) else str(value)
        size = len(raw)
        text = repr(raw[:limit]) if quote else _escaped(raw[:limit])
    return text if size <= limit else f"{text}... ({size} chars)"


def _escaped(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Window:
    """One key of a LogLimiter: when its window opened, lines let through in it, lines
    suppressed since the last one let through."""

    __slots__ = ("logged", "start", "suppressed")

    def __init__(self, start: float) -> None:
        self.start = start
        self.logged = 1
        self.suppressed = 0


class LogLimiter:
    """Rate limit for log lines an outside source can repeat at will (malformed calls,
    refused requests): per key (the source and what it did), the first `burst` lines of
    a window of `interval_s` go through, the rest are counted; the first line let
    through after that says how many were suppressed.

    Memory is bounded: at most `max_keys` keys are tracked, the least recently seen is
    forgotten first (its count of suppressed lines with it). `clock` is injectable
    (monotonic seconds) so that tests need no sleeps.
    """

    def __init__(
        self,
        interval_s: float = 10.0,
        burst: int = 1,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0 or burst < 1 or max_keys < 1:
            raise ValueError("LogLimiter needs interval_s > 0, burst >= 1 and max_keys >= 1")
        self.interval_s = interval_s
        self.burst = burst
        self.max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[Hashable, _Window] = OrderedDict()

    def allow(self, key: Hashable) -> int | None:
        """None: drop this line. Otherwise log it: the number of lines of `key` suppressed
        since the last one let through (0: none)."""
        now = self._clock()
        seen = self._keys.get(key)
        if seen is None:
            self._keys[key] = _Window(now)
            if len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
            return 0
        self._keys.move_to_end(key)
        if now - seen.start >= self.interval_s:
            seen.start, seen.logged = now, 0
        if seen.logged >= self.burst:
            seen.suppressed += 1
            return None
        seen.logged += 1
        suppressed, seen.suppressed = seen.suppressed, 0
        return suppressed

    def log(
        self,
        logger: logging.Logger,
        level: int,
        key: Hashable,
        msg: str,
        *args: object,
        extra: dict[str, object] | None = None,
    ) -> bool:
        """`logger.log(level, msg, *args)` unless `key` is over its rate; the line then
        ends with how many similar ones were suppressed before it. True if logged."""
        if not logger.isEnabledFor(level):
            return False
        suppressed = self.allow(key)
        if suppressed is None:
            return False
        if suppressed:
            msg, args = f"%s ({suppressed} similar suppressed)", (msg % args if args else msg,)
        logger.log(level, msg, *args, extra=extra)
        return True

    def forget(self, key: Hashable) -> int:
        """Stop tracking `key` (its source is gone): the lines of it suppressed since the
        last one logged, for a closing line to mention."""
        seen = self._keys.pop(key, None)
        return 0 if seen is None else seen.suppressed

    def __len__(self) -> int:
        return len(self._keys)


def bounded(message: str) -> str:
    """The backstop of both formatters: a message escaped and cut at MESSAGE_LIMIT, so
    that no call site, however careless, forges a line or writes a megabyte one."""
    return shown(message, MESSAGE_LIMIT, quote=False)


class TextFormatter(logging.Formatter):
    """The readable line, its message bounded (a traceback below it is kept as is)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = bounded(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": bounded(record.getMessage()),
        }
        for key in _EXTRA_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                # JSON escapes it; only its length needs a bound.
                doc[key] = value[:SHOWN_LIMIT] if isinstance(value, str) else value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger once, on stderr (journald and containers collect it)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    set_level(level)


def set_level(level: str) -> None:
    """Change the least severe level emitted (used at start-up and by a reload)."""
    logging.getLogger().setLevel(getattr(logging, level, logging.INFO))

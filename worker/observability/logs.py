"""Structured logs: one record per line with the request id and attempt when there is one, as JSON (for log
collectors; the default when stderr is not a terminal) or as ``key=value`` text (a person at a terminal).

Rule: log records carry identifiers and outcomes, never secrets, prompts or model output.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Literal, get_args

import msgspec

__all__ = ["LEVELS", "LOG_FORMATS", "JsonFormatter", "LogFormat", "TextFormatter", "parse_level", "setup_logging"]

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_ENC = msgspec.json.Encoder()
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LogFormat = Literal["auto", "json", "text"]
LOG_FORMATS: tuple[LogFormat, ...] = get_args(LogFormat)


def parse_level(text: str) -> str:
    """``debug`` / ``DEBUG`` / ``Warning`` → the level name. Raises ``ValueError`` naming the choices."""
    level = text.strip().upper()
    if level == "WARN":
        level = "WARNING"
    if level not in LEVELS:
        raise ValueError(f"unknown log level {text!r}; one of: {', '.join(s.lower() for s in LEVELS)}")
    return level


def _extras(record: logging.LogRecord) -> dict[str, object]:
    return {
        k: v if isinstance(v, str | int | float | bool | type(None)) else str(v)
        for k, v in record.__dict__.items()
        if k not in _STANDARD and not k.startswith("_")
    }


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(_extras(record))
        if record.exc_info and record.exc_info[0] is not None:
            doc["exc_type"] = record.exc_info[0].__name__
        return _ENC.encode(doc).decode()


class TextFormatter(logging.Formatter):
    """``12:00:01 warning route claude: ... key=value``: the same fields, for reading."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = f"{stamp} {record.levelname.lower():7} {record.getMessage()}" + (f"  {fields}" if fields else "")
        if record.exc_info and record.exc_info[0] is not None:
            line += f"  exc_type={record.exc_info[0].__name__}"
        return line


def setup_logging(level: str = "INFO", fmt: LogFormat = "auto") -> None:
    """Log ``sluice.*`` to stderr at ``level`` (any case). ``auto``: text on a terminal, else JSON lines.
    Raises ``ValueError`` for an unknown level."""
    handler = logging.StreamHandler(sys.stderr)
    text = fmt == "text" or (fmt == "auto" and sys.stderr.isatty())
    handler.setFormatter(TextFormatter() if text else JsonFormatter())
    root = logging.getLogger("sluice")
    root.handlers[:] = [handler]
    root.setLevel(parse_level(level))
    root.propagate = False

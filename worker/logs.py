"""Structured JSON logs: one object per line with the request id and attempt when there is one.

Rule: log records carry identifiers and outcomes, never secrets, prompts or model output.
"""

from __future__ import annotations

import logging
import sys
import time

import msgspec

__all__ = ["JsonFormatter", "setup_logging"]

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_ENC = msgspec.json.Encoder()


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STANDARD and not k.startswith("_"):
                doc[k] = v if isinstance(v, str | int | float | bool | type(None)) else str(v)
        if record.exc_info and record.exc_info[0] is not None:
            doc["exc_type"] = record.exc_info[0].__name__
        return _ENC.encode(doc).decode()


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("sluice")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False

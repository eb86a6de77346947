"""The node's log on stderr: readable text by default, one JSON object per event with
``--log-format json`` (for log collectors)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

from gossipmesh.report import json_safe

LOG_FORMATS = ("text", "json")
NODE_LOGGER = "gossipmesh"  # the daemon's own account of what it does


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message", ...}``; the event's ``fields`` (``extra=``) join
    the object."""

    def format(self, record: logging.LogRecord) -> str:
        event = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(json_safe(event), allow_nan=False, default=str)


class TextFormatter(logging.Formatter):
    """The daemon's own lines as they are; others (library warnings) as ``LEVEL logger: message``."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name == NODE_LOGGER and record.levelno == logging.INFO:
            line = record.getMessage()
            return line + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")
        return f"{record.levelname} {record.name}: {super().format(record)}"


def configure(log_format: str) -> None:
    """Send every log record to stderr in ``log_format`` (replacing handlers a parent set)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)

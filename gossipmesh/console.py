"""Human-facing progress: the live per-node table of a mesh and a node's progress line."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from gossipmesh.logs import NODE_LOGGER
from gossipmesh.report import json_safe

_node_log = logging.getLogger(NODE_LOGGER)
COLUMNS = (
    ("node", "id", "{}"),
    ("rank", "rank", "{}"),
    ("status", "status", "{}"),
    ("step", "step", "{}"),
    ("loss", "loss", "{:.4f}"),
    ("acc", "accuracy", "{:.3f}"),
    ("sent", "bytes_sent", "bytes"),
    ("recv", "bytes_received", "bytes"),
    ("peers", "peers", "{}"),
)
#: the mesh's table adds how far each node's model is from the average model (its live estimate)
#: and, with --shard, the bytes of each machine's rank 0 shard (parameters and optimizer state)
MESH_COLUMNS = (*COLUMNS, ("shard", "shard_bytes", "bytes"), ("from avg", "from_average", "{:.1e}"))


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _cell(row: Mapping[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    return human_bytes(value) if fmt == "bytes" else fmt.format(value)


def render_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    cells = [[title for title, _, _ in MESH_COLUMNS]]
    cells += [[_cell(row, key, fmt) for _, key, fmt in MESH_COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(MESH_COLUMNS))]
    return ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells]


class LiveTable:
    """Redraws the table in place on a terminal; elsewhere prints it every ``every_s`` seconds."""

    def __init__(self, stream: TextIO, *, interactive: bool, every_s: float = 5.0) -> None:
        self._stream = stream
        self._interactive = interactive
        self._every_s = every_s
        self._drawn = 0
        self._last = 0.0

    def update(self, rows: Sequence[Mapping[str, Any]], header: str, force: bool = False) -> None:
        now = time.monotonic()
        if not self._interactive and not force and now - self._last < self._every_s:
            return
        self._last = now
        lines = [header, *render_table(rows)]
        if self._interactive and self._drawn:
            self._stream.write(f"\x1b[{self._drawn}F\x1b[J")  # back to the table's first line
        self._stream.write("\n".join(lines) + "\n")
        self._stream.flush()
        self._drawn = len(lines) if self._interactive else 0


def progress_line(row: Mapping[str, Any]) -> str:
    """One line for ``gossipmesh node``: step, loss, accuracy, bytes, peers."""
    return "  ".join(f"{title} {_cell(row, key, fmt)}" for title, key, fmt in COLUMNS[3:])


def say(progress: str, text: str, **fields: Any) -> None:
    """A line for people in the node's log (unless ``--progress none``); ``fields`` are what a
    JSON log carries beside it."""
    if progress != "none":
        _node_log.info(text, extra={"fields": fields})


def emit(progress: str, event: Mapping[str, Any]) -> None:
    """A machine-readable progress event on stdout (``--progress json``, read by the mesh)."""
    if progress == "json":
        print(json.dumps(json_safe(dict(event)), allow_nan=False), flush=True)

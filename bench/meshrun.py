"""Runs a local mesh quietly for a benchmark and returns its run report."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any

import node


def quiet_mesh(argv: list[str], keep: Path | None = None) -> dict[str, Any]:
    """``gossipmesh mesh ARGV`` with its live table silenced; the report (raises on failure).
    ``keep``: the run directory to leave its reports and logs in (else a temporary one)."""
    with contextlib.ExitStack() as stack:
        run_dir = keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        with contextlib.redirect_stdout(io.StringIO()) as shown:
            code = node.main(["mesh", *argv, "--run-dir", str(run_dir)])
        if code != 0:
            command = "gossipmesh mesh " + " ".join(argv)
            raise RuntimeError(f"{command} failed ({code}):\n{shown.getvalue()[-2000:]}")
        report: dict[str, Any] = json.loads((run_dir / "report.json").read_text())
    return report

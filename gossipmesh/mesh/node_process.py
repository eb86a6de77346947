"""One daemon of a local mesh, as a forked process: its files, its progress, its fate."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gossipmesh.report import Progress, TimelinePoint, node_record, read_json

NodeMain = Callable[[Sequence[str]], int]
_LOG_TAIL_LINES = 15


class NodeProcess:
    """A node of the mesh: forked with stdout on a pipe (its JSON progress lines) and stderr in
    its log; the launcher reads the pipe without threads (``read_available``)."""

    def __init__(self, rank: int, address: str, run_dir: Path) -> None:
        self.rank = rank
        self.id = f"node-{rank}"
        self.address = address
        self.log = run_dir / f"{self.id}.log"
        self.report = run_dir / f"{self.id}.json"
        self.params = run_dir / f"{self.id}.npy"
        self.live_params = run_dir / f"{self.id}.live.npy"  # (--live-params)
        self.row: dict[str, Any] = {"id": self.id, "rank": rank, "status": "starting"}
        self.timeline: list[TimelinePoint] = []
        self.exit_code: int | None = None
        self.t_killed: float | None = None
        self.progress_fd = -1
        self._pid = 0
        self._partial = b""

    def start(self, node_main: NodeMain, argv: list[str], enter: Callable[[], None] | None = None) -> None:
        """Fork and run ``node_main(argv)`` in the child (which never returns here), after
        ``enter()`` (e.g. moving into a network namespace) when given."""
        read_fd, write_fd = os.pipe()
        log_fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _run_forked(node_main, argv, stdout_fd=write_fd, stderr_fd=log_fd, enter=enter)
        os.close(write_fd)
        os.close(log_fd)
        os.set_blocking(read_fd, False)
        self._pid, self.progress_fd = pid, read_fd

    def read_available(self) -> bool:
        """Consume the progress lines waiting on the pipe; False at end of file (the caller
        then stops watching the pipe and calls :meth:`close_progress`)."""
        try:
            data = os.read(self.progress_fd, 1 << 16)
        except BlockingIOError:
            return True
        if not data:
            return False
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            self._on_event(line)
        return True

    def close_progress(self) -> None:
        os.close(self.progress_fd)
        self.progress_fd = -1

    def _on_event(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            return
        if event.get("event") == "point":
            self.row.update(event, status="training")
            self.timeline.append(
                TimelinePoint(**{k: event[k] for k in TimelinePoint.__dataclass_fields__ if k in event})
            )
        elif event.get("event") == "ready":
            self.row.update(status="ready")

    @property
    def pid(self) -> int:
        return self._pid

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self._pid, signum)

    def poll(self) -> int | None:
        if self.exit_code is None:
            pid, status = os.waitpid(self._pid, os.WNOHANG)
            if pid:
                self.exit_code = os.waitstatus_to_exitcode(status)
                if self.t_killed is not None:
                    self.row["status"] = "killed"
                elif self.row["status"] in ("starting", "ready", "training"):
                    self.row["status"] = "finished" if self.exit_code == 0 else f"failed ({self.exit_code})"
        return self.exit_code

    def result(self) -> dict[str, Any]:
        """This node's entry of the mesh report. A node that left no report (killed, crashed)
        gets one from what its progress lines said."""
        if self.report.exists() and self.t_killed is None:
            node: dict[str, Any] = read_json(self.report)["nodes"][0]
            return node
        last = self.timeline[-1] if self.timeline else None
        progress = Progress(
            steps=last.step if last else 0,
            t_first_step=self.timeline[0].t if self.timeline else None,
            timeline=self.timeline,
            final={"loss": last.loss, "accuracy": last.accuracy} if last else {},
        )
        record = node_record(
            id=self.id,
            rank=self.rank,
            address=self.address,
            status="killed" if self.t_killed is not None else "failed",
            progress=progress,
            t_killed=self.t_killed,
            error=None
            if self.t_killed is not None
            else f"exited with code {self.poll()} without a report; see {self.log}",
        )
        return asdict(record)

    def membership_events(self) -> list[dict[str, Any]]:
        if not self.report.exists():
            return []
        events: list[dict[str, Any]] = read_json(self.report).get("membership_events", [])
        return events

    def log_tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join("    " + line for line in lines[-_LOG_TAIL_LINES:])


def preload_for_nodes() -> None:
    """Import once, before forking nodes, what each would import: building the first torch
    optimizer pulls in torch._dynamo, seconds of CPU per process (a restarted node that paid
    them could find that the mesh it rejoins has finished meanwhile)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _run_forked(
    node_main: NodeMain, argv: list[str], *, stdout_fd: int, stderr_fd: int, enter: Callable[[], None] | None
) -> None:
    """The body of a forked node: its own session, its own stdout and stderr; never returns."""
    code = 1
    try:
        os.setsid()
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives until _exit
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        if enter is not None:
            enter()
        code = node_main(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

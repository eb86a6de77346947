"""Metrics scraped from a running mesh, the report with phase timings, its plot; JSON logs."""

from __future__ import annotations

import http.client
import json
import logging
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import HANG_S

from gossip.phases import PHASES
from gossipmesh import logs
from node import main
from p2p.address import free_ports

NODE_PY = str(Path(__file__).resolve().parents[1] / "node.py")
NAMED_METRICS = (
    "gossipmesh_steps_total", "gossipmesh_rounds_total", "gossipmesh_train_loss", "gossipmesh_eval_loss",
    "gossipmesh_sent_bytes_total", "gossipmesh_received_bytes_total",
    "gossipmesh_round_duration_seconds_bucket", "gossipmesh_round_phase_seconds_bucket",
    "gossipmesh_staleness_max_rounds",
    "gossipmesh_consensus_distance_ratio", "gossipmesh_peers", "gossipmesh_build_info",
    "gossipmesh_phase_seconds_total",
)  # fmt: skip


def get(url: str) -> tuple[int, str]:
    """(status, body); (0, "") while nothing answers there. Polling a local port before its server
    listens can connect the client to itself (TCP simultaneous open, when the kernel picks that
    very port as the source): its own request comes back as a status line, also "nothing yet"."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, http.client.HTTPException):
        return 0, ""


def samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of a Prometheus text page."""
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


def scrape_while_training(mesh: subprocess.Popen[str], port: int, until_steps: int) -> dict[str, float]:
    """The node's metrics once it has taken ``until_steps`` steps; fails if the mesh ends first."""
    while mesh.poll() is None:
        status, text = get(f"http://127.0.0.1:{port}/metrics")
        if status == 200 and samples(text).get("gossipmesh_steps_total", 0) >= until_steps:
            return samples(text)
        time.sleep(0.1)
    raise AssertionError(f"the mesh ended before node on :{port} reached step {until_steps}")


@pytest.mark.mesh
def test_charlm_mesh_metrics_move_and_the_report_is_plotted(tmp_path: Path) -> None:
    port = free_ports(1, block=3)[0]
    mesh = subprocess.Popen(
        [sys.executable, NODE_PY, "mesh", "--nodes", "3", "--task", "charlm", "--steps", "100",
         "--algorithm", "dpsgd", "--lr", "0.3", "--eval-interval", "1", "--metrics-port", str(port),
         "--run-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        early = scrape_while_training(mesh, port, 15)
        assert get(f"http://127.0.0.1:{port}/readyz")[0] == 200
        assert get(f"http://127.0.0.1:{port + 1}/healthz")[0] == 200
        late = scrape_while_training(mesh, port, 60)
    finally:
        output, _ = mesh.communicate(timeout=HANG_S)
    assert mesh.returncode == 0, output
    for name in NAMED_METRICS:
        assert any(key.startswith(name) for key in late), name
    for counter in ("steps_total", "rounds_total", "sent_bytes_total", "received_bytes_total"):
        assert late[f"gossipmesh_{counter}"] > early[f"gossipmesh_{counter}"], counter
    assert late['gossipmesh_round_phase_seconds_count{phase="wait"}'] >= 59
    assert late['gossipmesh_peers{state="alive"}'] == 2
    assert late["gossipmesh_eval_loss"] < early["gossipmesh_eval_loss"]

    report = json.loads((tmp_path / "report.json").read_text())
    for node in report["nodes"]:
        first, last = node["timeline"][0], node["timeline"][-1]
        assert first["loss"] > 4.0 and last["loss"] < first["loss"] - 1.5, node["id"]  # ln(97) = 4.57
        assert set(node["phase_seconds"]) == set(PHASES) and node["phase_seconds"]["compute"] > 0
        assert node["shard"]["partition"] == "iid" and node["shard"]["examples"] > 4000
        assert any(point["consensus"] for point in node["timeline"])
        assert not node["rejected_by_reason"], node["rejected_by_reason"]  # every value mixed in
    plot = tmp_path / "report.png"
    assert f"plot: {plot}" in output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 30_000


def test_report_command_summarizes_where_the_time_went(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = {
        "id": "node-0", "status": "finished", "steps": 10, "final": {"accuracy": 0.9}, "bytes_sent": 2e6,
        "phase_seconds": {"compute": 3.0, "encode": 0, "send": 0, "wait": 1.0, "decode": 0, "mix": 0},
        "timeline": [{"t": 0.5, "loss": 2.0, "accuracy": 0.1, "bytes_sent": 0, "consensus": None},
                     {"t": 1.0, "loss": 1.0, "accuracy": 0.9, "bytes_sent": 2e6, "consensus": 0.01}],
    }  # fmt: skip
    run = tmp_path / "run.json"
    run.write_text(json.dumps({
        "wall_time_s": 1.2, "config": {}, "nodes": [node], "consensus_distance": 1e-3,
        "average_model": {"loss": 0.9, "accuracy": 0.925},
        "membership_events": [{"t": 0.8, "observer": "x", "node": "node-1", "event": "dead"}],
        "chaos_events": [{"t": 0.7, "action": "kill", "node": "node-1"},
                         {"t": 0.2, "action": "pause", "node": "node-0"},
                         {"t": 0.4, "action": "resume", "node": "node-0"}],
    }))  # fmt: skip
    assert main(["report", str(run), "--png", str(tmp_path / "plot.png")]) == 0
    out = capsys.readouterr().out
    assert "consensus distance 1.00e-03; the average model's accuracy 0.925" in out
    assert re.search(r"node-0\s+finished\s+10\s+0.900\s+2.0\s+75.0%\s+0.0%\s+0.0%\s+25.0%", out), out
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["report", str(tmp_path / "missing.json")]) == 1


def test_json_log_lines_are_one_object_per_event(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.configure("json")
        logging.getLogger(logs.NODE_LOGGER).info(
            "step 5", extra={"fields": {"step": 5, "loss": float("nan")}}
        )
        logging.getLogger("gossip.algorithms.averager").warning("ring is not defined for %d members", 2)
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert (first["message"], first["step"], first["loss"], first["level"]) == ("step 5", 5, None, "info")
    assert (second["logger"], second["message"]) == (
        "gossip.algorithms.averager",
        "ring is not defined for 2 members",
    )
    assert second["time"].endswith("+00:00")

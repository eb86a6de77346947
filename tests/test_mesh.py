"""End to end: real daemons as separate processes, through the command line users run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import HANG_S

from gossipmesh.daemon import pacing
from gossipmesh.daemon.pacing import StepPacer
from node import main
from topologies import NAMES, Topology

NODE_PY = str(Path(__file__).resolve().parents[1] / "node.py")
NODE_FIELDS = {
    "id", "rank", "t_first_step", "status", "steps", "final", "bytes_sent", "bytes_received",
    "messages_rejected", "timeline",
}  # fmt: skip


@pytest.mark.mesh
def test_default_mesh_trains_every_node_to_target(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, NODE_PY, "mesh", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4/4 nodes finished" in result.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) >= {"wall_time_s", "config", "nodes", "consensus_distance"}
    assert report["config"]["nodes"] == 4 and report["config"]["topology"] == "ring"
    # the default (--algorithm auto): 10 local steps, then a D-PSGD round that passes over stragglers
    assert report["config"]["algorithm"] == "dpsgd:stragglers=tolerate"
    assert report["config"]["local_steps"] == 10
    nodes = report["nodes"]
    assert [n["rank"] for n in nodes] == [0, 1, 2, 3]
    assert len({n["id"] for n in nodes}) == 4
    for node in nodes:
        assert set(node) >= NODE_FIELDS
        assert node["status"] == "finished" and node["steps"] == 600
        assert node["final"]["accuracy"] >= 0.93, node["final"]
        # a model a round to each of 2 neighbours, but for those passed over or whose link
        # still carried the last: at least one
        assert node["bytes_sent"] > 600 // 10 * 4 * 8970
        assert node["messages_rejected"] == 0, node["rejected_by_reason"]
        timeline = node["timeline"]
        times = np.array([p["t"] for p in timeline])
        assert 0 < node["t_first_step"] <= times[0] < report["wall_time_s"]
        assert np.median(np.diff(times)) <= 0.3 and np.diff(times).max() < 1.5
        assert [p["step"] for p in timeline] == sorted(p["step"] for p in timeline)
        assert timeline[-1]["accuracy"] == node["final"]["accuracy"]
        assert any(p["consensus"] for p in timeline)  # estimated between mixing and the outer step
    assert report["consensus_distance"] < 0.02
    # ...after the final exchange: each node sent its model to its 2 neighbours and mixed theirs
    # (one may come after the 5 s its neighbour waits, on a machine busy enough)
    assert all(n["staleness"]["final_expected"] == 2 for n in nodes)
    assert sum(n["staleness"]["final_mixed"] for n in nodes) >= 6
    # the nodes trained on different shards but agree: their accuracies are within 2 points
    accuracies = [n["final"]["accuracy"] for n in nodes]
    assert max(accuracies) - min(accuracies) <= 0.02
    # the mean of the final models, evaluated by the launcher: no worse than its worst node
    assert report["average_model"]["accuracy"] >= min(accuracies) - 0.01
    assert "of the average model" in result.stdout and "from avg" in result.stdout
    # each node's final model is as close to the average as the consensus distance says
    assert sorted(report["distance_from_average"]) == sorted(n["id"] for n in nodes)
    assert max(report["distance_from_average"].values()) < 0.02
    # estimated during the run from the nodes' live copies: no worse than the worst node then
    estimates = report["average_model_timeline"]
    assert estimates and [e["t"] for e in estimates] == sorted(e["t"] for e in estimates)
    for estimate in estimates:  # (from copies up to a second old)
        assert 1 <= estimate["nodes"] <= 4
        assert len(estimate["distance_from_average"]) == estimate["nodes"]
        then = [p["accuracy"] for n in nodes for p in n["timeline"] if abs(p["t"] - estimate["t"]) <= 2.0]
        assert estimate["accuracy"] >= min(then) - 0.05, (estimate, min(then))


@pytest.mark.mesh
def test_node_stops_gracefully_on_sigterm_and_writes_its_report(tmp_path: Path) -> None:
    report = tmp_path / "node.json"
    process = subprocess.Popen(
        [sys.executable, NODE_PY, "node", "--listen", "tcp://127.0.0.1:0", "--duration", "120",
         "--compute-ms", "5", "--report", str(report), "--progress", "json", "--insecure"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert process.stdout is not None
    for line in process.stdout:  # wait until it trains
        if json.loads(line).get("step", 0) > 5:
            break
    process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert process.wait(timeout=HANG_S) == 0, process.stderr.read() if process.stderr else ""
    assert time.monotonic() - started < 10
    assert process.stderr is not None and "RUNNING WITHOUT CURVE (--insecure)" in process.stderr.read()
    written = json.loads(report.read_text())
    (node,) = written["nodes"]
    assert node["status"] == "finished" and node["steps"] > 5 and node["rank"] == 0
    assert written["consensus_distance"] == 0.0


def test_cli_errors_are_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["node", "--topology", "donut"]) == 2
    assert capsys.readouterr().err.startswith("gossipmesh: error: --topology: unknown topology 'donut'")
    assert main(["mesh", "--nodes", "0"]) == 2
    assert "--nodes: must be >= 1, got 0" in capsys.readouterr().err
    assert main(["mesh", "--nodes", "300"]) == 2
    assert "--nodes: must be in 1..256, got 300" in capsys.readouterr().err


def test_pacer_stretches_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    pacer = StepPacer(compute_ms=20, slowdown=4)
    started = time.monotonic()
    pacer.finish_step(started)
    assert time.monotonic() - started >= 0.08
    sleeps: list[float] = []
    monkeypatch.setattr(pacing.time, "sleep", sleeps.append)
    StepPacer().finish_step(time.monotonic())
    assert sleeps == []  # unpaced: a step lasts what it takes


@pytest.mark.mesh
@pytest.mark.parametrize("name", [n for n in NAMES if n != "file:PATH"] + ["file"])
def test_mesh_runs_on_every_topology(name: str, tmp_path: Path, no_other_threads: None) -> None:
    nodes, steps = 8, 40
    if name == "file":  # a ring with one chord
        graph = tmp_path / "graph.txt"
        graph.write_text("\n".join(f"{i} {(i + 1) % nodes}" for i in range(nodes)) + "\n0 4\n")
        name = f"file:{graph}"
    argv = [
        "mesh",
        "--nodes",
        str(nodes),
        "--topology",
        name,
        "--steps",
        str(steps),
        "--run-dir",
        str(tmp_path),
        "--algorithm",
        "dpsgd:stragglers=wait",  # a round every step, to every neighbour the graph gives
        "--plot",
        "none",  # drawn in test_observability; 15 meshes here
        "--insecure",  # CURVE is the default mesh's and test_security's subject, not the graph's
    ]
    assert main(argv) == 0, (tmp_path / "node-0.log").read_text()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["topology"] == name
    topology = Topology.parse(name)
    model_bytes = 4 * (64 * 128 + 128 + 128 * 10 + 10)
    for node in report["nodes"]:
        assert node["status"] == "finished" and node["steps"] == steps
        assert node["messages_rejected"] == 0, node["rejected_by_reason"]
        # the node sent its model to the nodes the topology says, every round (in the last
        # round or two, nodes that finished first have left: up to 2 rounds of slack)
        sends = sum(len(topology.sends_to(nodes, node["rank"], r)) for r in range(steps))
        slack = 2 * (nodes - 1)
        assert (
            (sends - slack) * model_bytes
            <= node["bytes_sent"]
            <= (sends + slack) * (model_bytes + 200) + 20_000
        )
        assert node["final"]["accuracy"] > 0.5
    assert report["consensus_distance"] < 0.2


@pytest.mark.mesh
def test_a_send_cap_holds_each_node_to_its_rate(tmp_path: Path) -> None:
    """--max-send-mbps 2 on a mesh whose rounds would go far faster: every node sends at 2
    Mbit/s (within 10%) while all train, with no membership message late enough to suspect."""
    argv = ["mesh", "--nodes", "3", "--max-send-mbps", "2", "--duration", "10", "--insecure"]
    assert main([*argv, "--run-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    nodes = report["nodes"]

    def stepped_last(timeline: list[dict[str, float]]) -> float:
        """When the node made its last training step (the final point follows the final
        exchange, which waits for the neighbours' last values and sends little)."""
        training = [p for p in timeline if p["step"] < timeline[-1]["step"]]
        return min(p["t"] for p in training if p["step"] == training[-1]["step"])

    def point(timeline: list[dict[str, float]], t: float) -> dict[str, float]:
        return max((p for p in timeline if p["t"] <= t), key=lambda p: p["t"])

    start, end = 3.0, min(stepped_last(n["timeline"]) for n in nodes)  # while every node trains

    for node in nodes:
        first, last = point(node["timeline"], start), point(node["timeline"], end)
        mbps = (last["bytes_sent"] - first["bytes_sent"]) * 8 / (last["t"] - first["t"]) / 1e6
        print(f"{node['id']} sent {mbps:.3f} Mbit/s under its 2 Mbit/s cap")
        assert 0.9 * 2 <= mbps <= 1.1 * 2
        assert node["status"] == "finished" and not node["rejected_by_reason"]
    assert not [e for e in report["membership_events"] if e["event"] in ("suspected", "dead")]

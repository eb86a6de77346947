"""Real daemons (forked processes on 127.0.0.1) under the mesh's fault schedule.

Each test reads like its scenario: start a mesh, kill / pause / stop / add nodes at given
times, then check what every survivor saw and how training went, from the run report.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from node import main

pytestmark = [pytest.mark.mesh, pytest.mark.usefixtures("no_other_threads")]

DETECTION_TARGET_S = 5.0
ROUND_TIMEOUT_S = 2.0


def run(tmp_path: Path, *argv: str) -> dict[str, Any]:
    """``gossipmesh mesh ARGV`` at 20 ms a step (50 steps a second at most: 500 steps last 10 s
    or more, so a fault scheduled at a given second finds the nodes training on any machine)."""
    assert main(["mesh", "--run-dir", str(tmp_path), "--compute-ms", "20", *argv]) == 0, (
        tmp_path / "report.json"
    ).read_text()[-2000:]
    report: dict[str, Any] = json.loads((tmp_path / "report.json").read_text())
    return report


def nodes_by_id(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["id"]: n for n in report["nodes"]}


def events(report: dict[str, Any], event: str, node: str) -> list[dict[str, Any]]:
    return [e for e in report["membership_events"] if e["event"] == event and e["node"] == node]


def longest_stall(timeline: list[dict[str, Any]]) -> float:
    """The longest time the node's gossip round did not advance (while it was training)."""
    longest, since = 0.0, timeline[0]["t"]
    for before, after in itertools.pairwise(timeline):
        if after["round"] > before["round"]:
            since = after["t"]
        longest = max(longest, after["t"] - since)
    return longest


def stall_allowed(timeline: list[dict[str, Any]]) -> float:
    """What a dead neighbour may stall a node's rounds for: one wait of at most the round
    timeout (the full timeout at the first rounds, before their times are known), the steps of
    the round around it (a round as long as the node's typical one here, which a loaded machine
    makes longer) and one gap between the points a thread samples (not at the round's end)."""
    pairs = list(itertools.pairwise(timeline))
    advanced = [after["t"] for before, after in pairs if after["round"] > before["round"]]
    typical_round = float(np.median(np.diff(advanced)))
    sampling_gap = max(after["t"] - before["t"] for before, after in pairs)
    return ROUND_TIMEOUT_S + typical_round + sampling_gap


def accuracy_at(timeline: list[dict[str, Any]], t: float) -> float:
    return float(next((p["accuracy"] for p in reversed(timeline) if p["t"] <= t), 0.0))


def test_two_nodes_killed_mid_training(tmp_path: Path) -> None:
    """Node 2's kill is due before any node can train: the schedule waits until every node has
    made its first step, then runs shifted by that delay (node 6 dies 5 s after node 2)."""
    report = run(tmp_path, "--nodes", "8", "--steps", "500", "--kill", "2@0.01", "--kill", "6@5")
    nodes = nodes_by_id(report)
    survivors = [n for n in nodes if n not in ("node-2", "node-6")]
    delay = report["chaos_delay_s"]
    assert delay > 0
    for victim, at in (("node-2", 0.01), ("node-6", 5)):
        assert nodes[victim]["status"] == "killed"
        assert nodes[victim]["t_killed"] == pytest.approx(at + delay, abs=0.2)
        assert nodes[victim]["t_first_step"] <= nodes[victim]["t_killed"]
        dead = {e["observer"]: e["t"] - nodes[victim]["t_killed"] for e in events(report, "dead", victim)}
        assert set(dead) == set(survivors)  # every survivor declared it dead...
        assert max(dead.values()) < DETECTION_TARGET_S, dead  # ...within the target
    assert {e["node"] for e in report["membership_events"] if e["event"] == "dead"} == {"node-2", "node-6"}
    for node in survivors:
        assert nodes[node]["status"] == "finished"
        assert nodes[node]["final"]["accuracy"] >= 0.93, (node, nodes[node]["final"])
        timeline = nodes[node]["timeline"]
        assert longest_stall(timeline) <= stall_allowed(timeline), node
    assert report["consensus_distance"] < 0.05


def test_a_node_joining_mid_run_starts_from_the_mesh_state(tmp_path: Path) -> None:
    report = run(tmp_path, "--nodes", "5", "--steps", "600", "--join", "1@6")
    nodes = nodes_by_id(report)
    joiner = nodes["node-5"]
    assert joiner["status"] == "finished" and joiner["t_joined"] is not None
    others = [nodes[f"node-{i}"]["timeline"] for i in range(5)]
    assert 6 <= joiner["t_joined"] < min(t[-1]["t"] for t in others)  # while the mesh trained
    first = joiner["timeline"][0]
    # it trains from the mesh's model, not from scratch (a fresh model scores ~0.1)
    assert first["accuracy"] >= min(accuracy_at(t, first["t"]) for t in others) - 0.05
    within = joiner["t_joined"] + 10
    assert accuracy_at(joiner["timeline"], within) >= min(accuracy_at(t, within) for t in others) - 0.01
    assert {e["observer"] for e in events(report, "joined", "node-5")} == {f"node-{i}" for i in range(5)}
    assert joiner["final"]["accuracy"] >= 0.93
    assert report["consensus_distance"] < 0.05


def test_a_paused_node_is_suspected_not_killed_and_a_leave_is_seen_at_once(tmp_path: Path) -> None:
    """Per-step rounds: the paused node's neighbours miss its values within their wait limit
    (tenfold a round) and have it probed at once. The default's rounds of 10 local steps wait
    longer than the pause, which the failure detector's own probes (one member a second, in
    turn) then miss 8-17% of the time: 5 observers, each probing it once in 5 s."""
    faults = ["--pause", "3@4:2.0", "--leave", "5@9"]
    report = run(tmp_path, "--nodes", "6", "--steps", "500", *faults, "--algorithm", "dpsgd")
    nodes = nodes_by_id(report)
    assert events(report, "suspected", "node-3")  # a 2 s pause is noticed...
    assert events(report, "alive", "node-3")  # ...refuted when it resumes...
    assert not events(report, "dead", "node-3")  # ...and never declared dead
    assert nodes["node-3"]["status"] == "finished" and nodes["node-3"]["final"]["accuracy"] >= 0.93
    # from when the launcher sent the leave (a launcher starved of CPU can send it seconds late,
    # after the others finished: then the test fails plainly on that, not on the detection)
    (sent,) = [c["t"] for c in report["chaos_events"] if c["action"] == "leave"]
    ended = min(nodes[f"node-{i}"]["timeline"][-1]["t"] for i in range(5))
    assert sent < ended - 1.0, (report["chaos_events"], ended)
    left = {e["observer"]: e["t"] - sent for e in events(report, "left", "node-5")}
    assert set(left) == {f"node-{i}" for i in range(5)}
    assert max(left.values()) < 1.0  # within one probe interval
    assert nodes["node-5"]["status"] == "finished" and nodes["node-5"]["steps"] > 0


@pytest.mark.slow
def test_no_false_deaths_over_half_a_minute_of_repeated_pauses(tmp_path: Path) -> None:
    """8 pauses of 0.8 s, one every 2.5 s: a third of the time the node is silent. The last is
    due 10 s before the end, which a schedule held by a slow start (chaos_delay_s) still meets."""
    pauses = [arg for t in np.arange(2.5, 22.5, 2.5) for arg in ("--pause", f"3@{t:g}:0.8")]
    report = run(tmp_path, "--nodes", "8", "--duration", "30", *pauses)
    assert not [e for e in report["membership_events"] if e["event"] == "dead"]
    assert all(n["status"] == "finished" for n in report["nodes"])
    assert len([c for c in report["chaos_events"] if c["action"] == "pause"]) == 8


def test_a_joiner_takes_a_17m_parameter_state_from_several_members(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 64-4096-4096-10 MLP: 68 MB of parameters, 137 MB of state with momentum, which the
    first state transfer could not move at all (every chunk queued at once, most dropped by
    the full send queue, and the joiner gave up after 60 s)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the task module is beside this test
    report = run(
        tmp_path, "--nodes", "3", "--duration", "20", "--join", "1@3", "--task", "wide_digits:make_task"
    )
    nodes = nodes_by_id(report)
    joiner = nodes["node-3"]
    transfer = joiner["state_transfer"]
    print(f"state transfer: {transfer}")
    assert joiner["status"] == "finished" and joiner["steps"] >= 1
    assert transfer["bytes"] == 2 * 4 * 17_088_522  # parameters and momentum, float32
    assert sum(transfer["chunks"].values()) == 131  # 1 MiB each...
    # ...from several members (a source that fell silent under load is dropped, the rest serve):
    # from every member that had trained for a second when the transfer began, as the joiner
    # then knew (on a loaded machine it may have heard of one training member only)
    began = joiner["t_joined"] - transfer["seconds"]
    training = [n for n in ("node-0", "node-1", "node-2") if nodes[n]["t_first_step"] < began - 1]
    assert len(transfer["chunks"]) >= min(2, len(training)) >= 1, (transfer, began, training)
    # it trains from the mesh's model (a fresh one scores ~0.1): as its sources' models were
    # while the state was read from them, not as the mesh is after the transfer (early in a
    # run the mesh's accuracy swings from step to step)
    start = joiner["t_joined"] - transfer["seconds"]
    during = [
        accuracy
        for source in transfer["chunks"]
        for accuracy in [
            accuracy_at(nodes[source]["timeline"], start),
            *(p["accuracy"] for p in nodes[source]["timeline"] if start <= p["t"] <= joiner["t_joined"]),
        ]
    ]
    assert joiner["timeline"][0]["accuracy"] >= min(during) - 0.1, (joiner["timeline"][0], during)

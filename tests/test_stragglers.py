"""Heterogeneous nodes on real daemons: each algorithm trains a mesh, and a node slowed 8x
does not hold the others back (except D-PSGD told to wait for every neighbour, which it should)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from gossipmesh.mesh import netns
from node import main

pytestmark = [pytest.mark.mesh, pytest.mark.usefixtures("no_other_threads")]

NODES, SLOW = 6, 2
PACE = 0.5  # the fast nodes' rate beside a straggler, at least, against their even run's
DURATION, COMPUTE_MS = 8, 20  # a run's seconds of training, and each step's emulated compute


def run(tmp_path: Path, algorithm: str, *argv: str, duration: int = DURATION) -> dict[str, Any]:
    run_dir = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"  # each run a folder of its own
    flags = ["mesh", "--nodes", str(NODES), "--algorithm", algorithm, "--duration", str(duration)]
    flags += ["--compute-ms", str(COMPUTE_MS)]
    flags.append("--insecure")  # pace, not security, is measured: CURVE's CPU would blur it on 2 cores
    assert main([*flags, "--run-dir", str(run_dir), *argv]) == 0
    report: dict[str, Any] = json.loads((run_dir / "report.json").read_text())
    return report


def fast_steps(report: dict[str, Any]) -> float:
    return statistics.median(n["steps"] for n in report["nodes"] if n["rank"] != SLOW)


def steady_rate(node: dict[str, Any]) -> float:
    """Steps per second over the second half of a node's run: start-up, which a busy machine
    stretches by seconds and unevenly between runs, is left out."""
    points = node["timeline"]
    middle = (points[0]["t"] + points[-1]["t"]) / 2
    start = next(p for p in points if p["t"] >= middle)
    return (points[-1]["step"] - start["step"]) / (points[-1]["t"] - start["t"])


def fast_rate(report: dict[str, Any]) -> float:
    return statistics.median(steady_rate(n) for n in report["nodes"] if n["rank"] != SLOW)


@pytest.mark.parametrize(
    ("algorithm", "flags"),
    [
        ("adpsgd", ()),
        ("sgp", ()),
        ("dpsgd", ()),
        ("choco", ("--compression", "int8")),
        ("dpsgd:backup=1,catch_up=0", ()),
    ],
)
def test_a_node_slowed_8x_does_not_hold_the_others_back(
    tmp_path: Path, algorithm: str, flags: tuple[str, ...]
) -> None:
    even = run(tmp_path, algorithm, *flags)
    slowed = run(tmp_path, algorithm, *flags, "--slowdown", f"{SLOW}:8")
    # held back, the fast nodes would step at about 1/8 of their even pace (the next test); the
    # issue's 0.8x is bench/stragglers.py's figure, which a test beside other tests cannot hold
    assert fast_rate(slowed) >= PACE * fast_rate(even), (fast_rate(slowed), fast_rate(even))
    for report in (even, slowed):
        assert all(n["status"] == "finished" for n in report["nodes"])
    # Every algorithm trains: 8 s of steps reach 0.93-0.95 on a quiet machine and less on a busy
    # one (fewer steps in the time), so the bar is the slow node's own.
    assert min(n["final"]["accuracy"] for n in even["nodes"]) >= 0.9
    slow = next(n for n in slowed["nodes"] if n["rank"] == SLOW)
    # it really was slow (at most a step of its own per 8 x 20 ms: loaded, the fast nodes' steps
    # need not be 5x its own, as they were quiet)...
    own_steps = slow["steps"] - slow["staleness"].get("steps_skipped", 0)
    assert own_steps <= DURATION / (8 * COMPUTE_MS / 1000), slow["steps"]
    if "catch_up=0" not in algorithm:  # ...yet, averaging asynchronously or catching up, it kept up
        assert slow["final"]["accuracy"] >= 0.9
    assert all("mean" in n["staleness"] for n in slowed["nodes"])


def test_a_straggler_that_catches_up_ends_its_step_budget_with_the_mesh(tmp_path: Path) -> None:
    """The default mesh (a ring of 4, 10 local steps, tolerant D-PSGD) with node 1 4x slower
    and a budget of 600 steps: it skips rounds to keep up and its step count moves on with
    them, so it ends when its neighbours do, on their last round's values. (Counting only its
    own steps, it trained its last ~240 alone after they left: 0.914 and a consensus distance
    of 0.25 against 0.95 and under 0.02.)"""
    flags = ["mesh", "--compute-ms", "2", "--slowdown", "1:4", "--insecure", "--plot", "none"]
    assert main([*flags, "--run-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    slow = report["nodes"][1]
    skipped = slow["staleness"]["steps_skipped"]
    assert skipped == 10 * slow["staleness"]["rounds_skipped"] > 0
    assert slow["steps"] - skipped < 600  # its own steps: fewer, the batches it drew
    assert 0 <= slow["timeline"][-1]["batches"] - (slow["steps"] - skipped) <= 1
    # (never past it: a skip stops at the round the budget ends at)
    assert all(n["status"] == "finished" and n["steps"] == 600 for n in report["nodes"])
    assert min(n["final"]["accuracy"] for n in report["nodes"]) >= 0.93
    assert report["distance_from_average"][slow["id"]] < 0.1


def test_dpsgd_told_to_wait_runs_at_the_pace_of_its_slowest_node(tmp_path: Path) -> None:
    slowed = run(tmp_path, "dpsgd:stragglers=wait", "--slowdown", f"{SLOW}:8")
    assert fast_steps(slowed) < 0.25 * DURATION / (COMPUTE_MS / 1000)  # at 1/8 of the pace or so


def test_a_local_steps_mesh_with_one_link_10x_slower_keeps_pace_and_every_node_above_0_9(
    tmp_path: Path,
) -> None:
    """Namespace hosts (root): every uplink at 4 Mbit/s, then the slow node's at 0.4, where its
    model to two ring neighbours takes longer than its 10 local steps. Its neighbours pass it
    over, it catches up with them, no outer step extrapolates a round that mixed too little:
    the fast nodes keep their pace (with ``stragglers=wait`` they ran at a quarter of it, 10-12
    steps/s against 41) and every node ends above 0.9. Every node ends on a round (its steps a
    multiple of 10): the slow node's model, which its own shard pulls away from the mesh's
    between rounds, is taken as mixing left it. 20 s: the slow link's values come a few a
    second, and a lag is known from the fourth."""
    if reason := netns.unavailable():
        pytest.skip(reason)
    flags = ("--hosts", "netns", "--local-steps", "10", "--link", "4")
    even = run(tmp_path, "dpsgd", *flags, duration=20)
    slowed = run(tmp_path, "dpsgd", *flags, "--link", f"{SLOW}:0.4", duration=20)
    assert fast_rate(slowed) >= PACE * fast_rate(even), (fast_rate(slowed), fast_rate(even))
    assert all(n["status"] == "finished" for n in slowed["nodes"])
    assert [n["steps"] % 10 for n in slowed["nodes"]] == [0] * NODES
    assert min(n["final"]["accuracy"] for n in slowed["nodes"]) >= 0.9


def test_nodes_with_different_batch_sizes_train_together(tmp_path: Path) -> None:
    report = run(tmp_path, "dpsgd", "--node-batch", "0:64", "--node-batch", "1:16", "--node-device", "2:cpu")
    assert min(n["final"]["accuracy"] for n in report["nodes"]) >= 0.93
    assert [n["device"] for n in report["nodes"]] == ["cpu"] * NODES  # (a GPU: bench/gpu_check.py)
    assert report["consensus_distance"] < 0.05

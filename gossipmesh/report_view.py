"""A run report for people: a table of the nodes (where their time went) and a figure.

The figure has four panels against wall time: held-out loss and accuracy per node (with the
accuracy of the average model: estimated during the run, and of the final models), the nodes'
consensus distance estimates (with the final measured distance), and bytes sent per second per
node. The mesh's faults are drawn on every panel: kills (red), joins (green) and graceful leaves
(orange) as lines, pauses as shaded spans, and the moment the survivors declared a node dead
(dotted).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from gossip.phases import PHASES

_FAULT_COLOURS = {"kill": "tab:red", "join": "tab:green", "leave": "tab:orange"}


def summarize(report: dict[str, Any]) -> list[str]:
    """One line per node: status, steps, final accuracy, bytes, and each phase's share of time."""
    average = report.get("average_model") or {}
    lines = [
        f"run of {report['wall_time_s']:.1f} s, {len(report['nodes'])} node(s); "
        f"consensus distance {_number(report.get('consensus_distance'), '.2e')}; "
        f"the average model's accuracy {_number(average.get('accuracy'), '.3f')}",
        f"{'node':>10} {'status':>9} {'steps':>6} {'acc':>6} {'sent MB':>8}  "
        + " ".join(f"{p:>7}" for p in PHASES),
    ]
    for node in report["nodes"]:
        phases = node.get("phase_seconds") or {}
        total = sum(phases.values())
        shares = [f"{100 * phases.get(p, 0.0) / total:6.1f}%" if total else f"{'-':>7}" for p in PHASES]
        lines.append(
            f"{node['id']:>10} {node['status']:>9} {node['steps']:>6} "
            f"{_number(node.get('final', {}).get('accuracy'), '.3f'):>6} "
            f"{node['bytes_sent'] / 1e6:>8.1f}  " + " ".join(shares)
        )
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    """Draw the report's figure to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    (loss_axis, accuracy_axis), (consensus_axis, rate_axis) = axes
    for node in report["nodes"]:
        timeline = node.get("timeline") or []
        t = np.array([p["t"] for p in timeline], dtype=float)
        loss_axis.plot(t, _series(timeline, "loss"), label=node["id"], linewidth=1)
        accuracy_axis.plot(t, _series(timeline, "accuracy"), linewidth=1)
        consensus_axis.plot(t, _series(timeline, "consensus"), linewidth=1)
        if len(t) > 1:
            rate = np.diff(_series(timeline, "bytes_sent")) / np.maximum(np.diff(t), 1e-9)
            rate_axis.plot((t[1:] + t[:-1]) / 2, rate, linewidth=1)
    estimates = report.get("average_model_timeline") or []
    if estimates:
        accuracy_axis.plot(
            [e["t"] for e in estimates], [e["accuracy"] for e in estimates], "k--", linewidth=1.5, zorder=3
        )
    average = report.get("average_model")
    if average:
        accuracy_axis.scatter(
            [report["wall_time_s"]], [average["accuracy"]], marker="*", s=120, color="k", zorder=3
        )
    final = report.get("consensus_distance")
    if final:
        consensus_axis.scatter([report["wall_time_s"]], [final], marker="*", s=120, color="k", zorder=3)
        consensus_axis.set_yscale("log")
    titles = (
        (loss_axis, "held-out loss"),
        (accuracy_axis, "held-out accuracy (-- the average model, * of the final models)"),
        (consensus_axis, "consensus distance (estimate per node; * measured at the end)"),
        (rate_axis, "bytes sent per second"),
    )
    for axis, title in titles:
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
        _draw_faults(axis, report)
    for axis in axes[1]:
        axis.set_xlabel("wall time (s)")
    if len(report["nodes"]) <= 16:
        loss_axis.legend(fontsize=7, ncol=2)
    config = report.get("config", {})
    figure.suptitle(
        f"{config.get('task', '?')} on {config.get('topology', '?')}, {config.get('algorithm', '?')}, "
        f"partition {config.get('partition', '?')}: {len(report['nodes'])} node(s)"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _series(timeline: list[dict[str, Any]], key: str) -> np.ndarray:
    return np.array([math.nan if p.get(key) is None else p[key] for p in timeline], dtype=float)


def _draw_faults(axis: Any, report: dict[str, Any]) -> None:
    paused: dict[str, float] = {}
    for event in report.get("chaos_events", []):
        if event["action"] in _FAULT_COLOURS:
            axis.axvline(event["t"], color=_FAULT_COLOURS[event["action"]], alpha=0.6, linewidth=1)
        elif event["action"] == "pause":
            paused[event["node"]] = event["t"]
        elif event["action"] == "resume" and event["node"] in paused:
            axis.axvspan(paused.pop(event["node"]), event["t"], color="0.6", alpha=0.3)
    declared: set[str] = set()
    for event in report.get("membership_events", []):
        if event["event"] == "dead" and event["node"] not in declared:
            declared.add(event["node"])
            axis.axvline(event["t"], color="k", linestyle=":", linewidth=1)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)

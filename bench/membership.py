"""Failure detection on a real local mesh: detection time over repeated kills, false positives.

One mesh of daemons trains while the schedule kills a node every ``--every`` seconds (a
replacement joins 2 s later, so the mesh keeps its size) and pauses another node (SIGSTOP) for
``--pause`` seconds every 5 s. For each kill, the detection time is when the last survivor
declared the victim dead; a false positive is a dead declaration of a node that was not killed.

    python bench/membership.py [--nodes 8] [--kills 8] [--every 8] [--pause 0.8] [--profile local]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import node
from p2p.membership.protocol import PROFILES


def schedule(nodes: int, kills: int, every: float, pause: float) -> tuple[list[str], float]:
    """Mesh flags for the run, and its duration."""
    duration = 5 + kills * every + 4
    argv: list[str] = []
    # node 0 (the first contact) and the last node (the paused one) are never killed; after the
    # others, the replacements die, in the order they joined
    victims = [*range(1, nodes - 1), *range(nodes, nodes + kills)][:kills]
    for k, rank in enumerate(victims):
        at = 5 + k * every
        argv += ["--kill", f"{rank}@{at:g}", "--join", f"1@{at + 2:g}"]
    paused = nodes - 1  # never killed
    for t in range(6, int(duration) - 2, 5):
        argv += ["--pause", f"{paused}@{t}:{pause:g}"]
    return argv, duration


def analyse(report: dict[str, Any]) -> dict[str, Any]:
    kills = {c["node"]: c["t"] for c in report["chaos_events"] if c["action"] == "kill"}
    dead = [e for e in report["membership_events"] if e["event"] == "dead"]
    detection = []
    for victim, t_kill in kills.items():
        times = [e["t"] - t_kill for e in dead if e["node"] == victim]
        detection.append(max(times) if times else float("inf"))
    suspected_live = [
        e for e in report["membership_events"] if e["event"] == "suspected" and e["node"] not in kills
    ]
    return {
        "kills": len(kills),
        "detection_median_s": statistics.median(detection),
        "detection_max_s": max(detection),
        "undetected": sum(d == float("inf") for d in detection),
        "false_deaths": sum(e["node"] not in kills for e in dead),
        "suspicions_of_live_nodes": len(suspected_live),
        "refutations": sum(e["event"] == "alive" for e in report["membership_events"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--every", type=float, default=8.0, help="seconds between kills")
    parser.add_argument("--pause", type=float, default=0.8, help="seconds each pause lasts")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="local")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    chaos, duration = schedule(args.nodes, args.kills, args.every, args.pause)
    with tempfile.TemporaryDirectory() as run_dir:
        argv = ["mesh", "--nodes", str(args.nodes), "--duration", f"{duration:g}", "--compute-ms", "20"]
        argv += ["--profile", args.profile, "--run-dir", run_dir, *chaos]
        node.main(argv)
        figures = analyse(json.loads((Path(run_dir) / "report.json").read_text()))
    profile = PROFILES[args.profile]
    figures |= {
        "profile": args.profile,
        "probe_interval_s": profile.probe_interval_s,
        "probe_timeout_s": profile.probe_timeout_s,
        "suspicion_timeout_s": profile.suspicion_timeout_s(args.nodes),
    }
    if args.json:
        print(json.dumps(figures))
        return
    print(
        f"\nfailure detection, {args.nodes} daemons, profile {args.profile} (probe every "
        f"{profile.probe_interval_s:g} s, timeout {profile.probe_timeout_s:g} s, suspicion "
        f"{figures['suspicion_timeout_s']:g} s); a {args.pause:g} s pause of one node every 5 s"
    )
    header = ("kills", "median s", "max s", "undetected", "false deaths", "suspicions")
    print(" ".join(f"{h:>12}" for h in header))
    row = (
        f"{figures['kills']}",
        f"{figures['detection_median_s']:.2f}",
        f"{figures['detection_max_s']:.2f}",
        f"{figures['undetected']}",
        f"{figures['false_deaths']}",
        f"{figures['suspicions_of_live_nodes']}",
    )
    print(" ".join(f"{cell:>12}" for cell in row))


if __name__ == "__main__":
    main()

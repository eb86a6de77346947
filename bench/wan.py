"""Time to accuracy where bandwidth binds: real daemons on namespace hosts behind capped links.

Each arm is ``gossipmesh mesh --hosts netns --nodes N --link MBPS ...`` (needs root): every node's
uplink limited with ``tc tbf``, a model whose sending costs (``--task``, a wide digits MLP), and
``--compute-ms`` standing for an accelerator's step. For each link setting (``100``: every uplink
at 100 Mbit/s; ``100+0:10``: the same with node 0 at 10) and each arm: seconds from the mesh's
start until every node's held-out accuracy reaches the target, the lowest final accuracy, MB sent
per node, and the speed-up against plain D-PSGD on the same links (">" when D-PSGD did not reach
the target within the run: a lower bound). A PNG plots the lowest node's
accuracy against wall time, one panel per link setting.

    sudo python bench/wan.py [--links 100,1000,100+0:10] [--arms dpsgd,H=10+int8,...]
                             [--task wan_task:width_1024] [--duration 90] [--png wan.png]
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
from compression import ARMS as COMPRESSION_ARMS
from matplotlib import colormaps, pyplot
from meshrun import quiet_mesh

from gossipmesh.mesh import netns

COLOURS = colormaps["tab20"]  # one colour an arm (the default cycle repeats after 10)

ARMS: dict[str, list[str]] = {
    "dpsgd": ["--algorithm", "dpsgd"],
    "default": [],  # --algorithm auto: 10 local steps over dpsgd:stragglers=tolerate
    "adpsgd": ["--algorithm", "adpsgd"],
    "sgp": ["--algorithm", "sgp"],
    **{arm: COMPRESSION_ARMS[arm] for arm in ("int8", "topk:0.01", "H=10", "H=10+int8", "H=10 overlap")},
    # the mesh agrees on H from measured times (gossip.tuning.auto_period)
    "H=auto": ["--local-steps", "auto", "--algorithm", "dpsgd"],
    "H=auto+int8": ["--local-steps", "auto", "--algorithm", "choco", "--compression", "int8"],
    "auto codec": ["--algorithm", "choco", "--compression", "auto"],  # gossip.tuning.auto_codec
    "H=auto+auto codec": ["--local-steps", "auto", "--algorithm", "choco", "--compression", "auto"],
}


def link_flags(setting: str) -> list[str]:
    """``100`` or ``100+0:10`` as --link flags."""
    return [flag for part in setting.split("+") for flag in ("--link", part)]


def reached(nodes: list[dict[str, Any]], target: float) -> float:
    """Mesh seconds until every node's accuracy reached ``target`` (inf if some never did)."""
    firsts = [next((p["t"] for p in n["timeline"] if p["accuracy"] >= target), math.inf) for n in nodes]
    return max(firsts)


def lowest_curve(nodes: list[dict[str, Any]], step_s: float = 0.5) -> tuple[list[float], list[float]]:
    """The lowest node's accuracy against mesh time (each node's latest evaluation, so a node
    that falls back shows)."""
    end = min(n["timeline"][-1]["t"] for n in nodes)
    times = [i * step_s for i in range(int(end / step_s) + 1)]

    def at(timeline: list[dict[str, Any]], t: float) -> float:
        return next((p["accuracy"] for p in reversed(timeline) if p["t"] <= t), 0.0)

    return times, [min(at(n["timeline"], t) for n in nodes) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--links", default="100,1000,100+0:10", help="link settings, one run each")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"from: {', '.join(ARMS)}")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--task", default="wan_task:width_1024")
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds each arm trains")
    parser.add_argument("--target", type=float, default=0.9, help="held-out accuracy every node must reach")
    parser.add_argument("--png", type=Path, default=Path("wan.png"))
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument(
        "--keep-runs", type=Path, help="leave each arm's run (report, node logs) in DIR/LINKS/ARM"
    )
    args = parser.parse_args()
    if why := netns.unavailable():
        parser.error(f"namespace hosts: {why}")
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        parser.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    settings = args.links.split(",")
    figure, axes = pyplot.subplots(1, len(settings), figsize=(6 * len(settings), 4.5), squeeze=False)
    rows = []
    print(
        f"{args.nodes} hosts, {args.task}, {args.compute_ms:g} ms steps, target {args.target} on every node"
    )
    print(f"{'link Mbit/s':>12} {'arm':<14} {'to target s':>11} {'x dpsgd':>8} {'final':>6} {'MB/node':>8}")
    for setting, axis in zip(settings, axes[0], strict=True):
        base = None
        for arm in arms:
            keep = args.keep_runs / setting / re.sub(r"[^\w.=+-]", "_", arm) if args.keep_runs else None
            report = quiet_mesh([
                "--hosts", "netns", *link_flags(setting), "--nodes", str(args.nodes), "--task", args.task,
                "--compute-ms", f"{args.compute_ms:g}", "--duration", f"{args.duration:g}", "--insecure",
                "--plot", "none", *ARMS[arm],
            ], keep)  # fmt: skip
            nodes = report["nodes"]
            seconds = reached(nodes, args.target)
            base = seconds if arm == "dpsgd" else base
            # (D-PSGD not at the target within the run: the speed-up is at least duration / seconds)
            bound = base if base is not None and math.isfinite(base) else args.duration
            speedup = bound / seconds if math.isfinite(seconds) else math.nan
            shown = f"{'>' if bound != base else ''}{speedup:.2f}"
            final = min(n["final"]["accuracy"] for n in nodes)
            mb = sum(n["bytes_sent"] for n in nodes) / len(nodes) / 1e6
            rows.append(
                {
                    "link": setting,
                    "arm": arm,
                    "seconds": seconds,
                    "speedup": speedup,
                    "final": final,
                    "mb": mb,
                }
            )
            print(
                f"{setting:>12} {arm:<14} {seconds:>11.1f} {shown:>8} {final:>6.3f} {mb:>8.1f}",
                flush=True,
            )
            axis.plot(*lowest_curve(nodes), label=arm, color=COLOURS(arms.index(arm) % COLOURS.N))
        axis.set(title=f"uplinks {setting} Mbit/s", xlabel="wall time (s)", ylabel="lowest node's accuracy")
        axis.axhline(args.target, color="grey", linestyle=":")
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(args.png)
    print(f"plot: {args.png}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Bytes against accuracy: each compression mode and local-steps setting against uncompressed D-PSGD.

Every arm trains the same task, model, learning rate and number of local steps on a real local
mesh (separate processes, a ring unless ``--topology`` names another). Reported per arm: bytes
sent per node and gossip rounds until every node reaches the target held-out accuracy (each node
counted at its first timeline point at or above the target), the lowest final accuracy, and the
ratios against the ``dpsgd`` arm: how many times fewer bytes and rounds, and the accuracy lost
in points. The compressed arms run CHOCO-SGD with its default consensus step size unless the arm
names one (γ); ``H=...`` arms take H local steps between gossip rounds with the outer Nesterov step
(``overlap``: the round's models are mixed one round later, communication behind the steps).

Also per arm: bytes sent per node (mean) by the time *every* node is at the target ("MB to all",
the stricter count), local steps and seconds (mesh clock) until every node is at the target, and
the final models' consensus distance (their distance from their average, over its norm).
``--partition dirichlet:0.5`` trains every arm on label-skewed shards.

    python bench/compression.py [--nodes 8] [--steps 800] [--target 0.93] [--arms dpsgd,int8,...]
                                [--partition iid|dirichlet:ALPHA] [--topology NAME]
                                [--compute-ms MS]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any

from meshrun import quiet_mesh

PLAIN_TOPK = "topk:0.01,values=float32,dense_every=0"
ARMS: dict[str, list[str]] = {
    "dpsgd": ["--algorithm", "dpsgd"],
    "fp16": ["--algorithm", "choco", "--compression", "fp16"],
    "bf16": ["--algorithm", "choco", "--compression", "bf16"],
    "int8": ["--algorithm", "choco", "--compression", "int8"],
    "topk:0.1": ["--algorithm", "choco", "--compression", "topk:0.1"],
    "topk:0.01": ["--algorithm", "choco", "--compression", "topk:0.01"],
    "topk:0.01@γ0.05": ["--algorithm", "choco:gamma=0.05", "--compression", "topk:0.01"],
    # top-1% as it was before issue 18: float32 values, no dense round, γ fixed at 2x the fraction
    "topk:0.01 before": ["--algorithm", "choco:gamma=0.02", "--compression", PLAIN_TOPK],
    "topk:0.01 float32": ["--algorithm", "choco", "--compression", PLAIN_TOPK],  # the adaptive γ alone
    "randk:0.1": ["--algorithm", "choco", "--compression", "randk:0.1"],
    "H=10": ["--local-steps", "10", "--algorithm", "dpsgd"],
    "H=50": ["--local-steps", "50", "--algorithm", "dpsgd"],
    "H=10 overlap": ["--local-steps", "10", "--algorithm", "dpsgd:overlap=1"],
    "H=50 overlap": ["--local-steps", "50", "--algorithm", "dpsgd:overlap=1"],
    "H=10+int8": ["--local-steps", "10", "--algorithm", "choco", "--compression", "int8"],
}


@dataclass
class Result:
    arm: str
    nodes: list[dict[str, Any]]
    seconds: float
    distance: float  # the final models' consensus distance, measured against their average

    def first_at(self, target: float, key: str, combine: Any = None) -> float:
        """``key`` at each node's first point at or above ``target``, averaged over the nodes
        (or ``combine``d: ``max``); inf when some node never got there."""
        values = []
        for node in self.nodes:
            point = next((p for p in node["timeline"] if p["accuracy"] >= target), None)
            if point is None:
                return math.inf
            values.append(point[key])
        return combine(values) if combine is not None else sum(values) / len(values)

    def bytes_when_all_at(self, target: float) -> float:
        """Bytes a node sent (mean over the nodes) by the time every node was at ``target``."""
        t = self.first_at(target, "t", max)
        if math.isinf(t):
            return math.inf
        sent = [max((p["bytes_sent"] for p in n["timeline"] if p["t"] <= t), default=0) for n in self.nodes]
        return sum(sent) / len(sent)

    @property
    def final(self) -> float:
        return min(n["final"]["accuracy"] for n in self.nodes)

    @property
    def total_mb(self) -> float:
        return sum(n["bytes_sent"] for n in self.nodes) / len(self.nodes) / 1e6


def table(results: list[Result], target: float) -> list[str]:
    base = next(r for r in results if r.arm == "dpsgd")
    base_bytes, base_rounds = base.first_at(target, "bytes_sent"), base.first_at(target, "round")
    base_all = base.bytes_when_all_at(target)
    lines = [
        f"{'arm':<22} {'MB to target':>12} {'x fewer':>8} {'MB to all':>9} {'x fewer':>8} {'rounds':>7} "
        f"{'x fewer':>8} {'steps':>6} {'s to all':>8} {'final acc':>9} {'loss pts':>8} {'distance':>9} "
        f"{'MB total':>9} {'run s':>6}"
    ]
    for r in results:
        mb, rounds = r.first_at(target, "bytes_sent") / 1e6, r.first_at(target, "round")
        mb_all = r.bytes_when_all_at(target) / 1e6
        steps, seconds = r.first_at(target, "step"), r.first_at(target, "t", max)
        lines.append(
            f"{r.arm:<22} {mb:>12.2f} {base_bytes / 1e6 / mb:>8.1f} {mb_all:>9.2f} "
            f"{base_all / 1e6 / mb_all:>8.1f} {rounds:>7.0f} {base_rounds / rounds:>8.1f} "
            f"{steps:>6.0f} {seconds:>8.1f} {r.final:>9.3f} "
            f"{100 * (base.final - r.final):>8.1f} {r.distance:>9.2e} {r.total_mb:>9.2f} {r.seconds:>6.0f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--steps", type=int, default=800, help="the step count every node trains to")
    parser.add_argument("--target", type=float, default=0.93, help="held-out accuracy every node must reach")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from: {', '.join(ARMS)}")
    parser.add_argument("--partition", default="iid", help="iid, or dirichlet:ALPHA (label skew)")
    parser.add_argument("--topology", default="ring", help="the mesh's topology (as mesh --topology)")
    parser.add_argument("--compute-ms", type=float, default=0.0, help="each step lasts at least this long")
    args = parser.parse_args()
    chosen = ["dpsgd", *(a for a in args.arms.split(",") if a != "dpsgd")]
    unknown = [a for a in chosen if a not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")

    results = []
    for arm in chosen:
        started = time.monotonic()
        argv = ["--nodes", str(args.nodes), "--steps", str(args.steps), "--partition", args.partition]
        argv += ["--topology", args.topology, "--compute-ms", f"{args.compute_ms:g}"]
        report = quiet_mesh([*argv, *ARMS[arm]])
        results.append(Result(arm, report["nodes"], time.monotonic() - started, report["consensus_distance"]))
        done = results[-1]
        print(f"  {arm}: {done.seconds:.0f} s, lowest final accuracy {done.final:.3f}", flush=True)
    print(
        f"\n{args.nodes} nodes, {args.topology}, {args.steps} local steps each, {args.partition} data, "
        f"target {args.target} on every node"
    )
    print("\n".join(table(results, args.target)))


if __name__ == "__main__":
    main()

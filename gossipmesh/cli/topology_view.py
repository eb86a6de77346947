"""``gossipmesh topology``: what a topology costs and buys, as text, JSON, a comparison or a PNG."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TextIO

from gossipmesh.config import TopologyConfig
from topologies import FAMILIES, Analysis, Topology, TopologyError, analyze
from topologies.graphs import torus_shape

#: the digits MLP's parameters in float32 (64 -> 128 -> 10): --model-bytes's default, stated here
#: so that the command need not build the model (and import torch) to know it
DIGITS_MODEL_BYTES = 4 * (64 * 128 + 128 + 128 * 10 + 10)
CONSENSUS_TARGET = 1e-3  # the "rounds to agree" column: distance shrunk by this factor


def run(config: TopologyConfig, stream: TextIO = sys.stdout) -> int:
    """``gossipmesh topology``: the analysis (text or JSON), a comparison, or a drawing."""
    model_bytes = config.model_bytes or DIGITS_MODEL_BYTES
    if config.compare:
        compare(config.nodes, model_bytes, stream)
        return 0
    topology = config.topology
    analysis = analyze(topology, config.nodes, model_bytes)
    if config.json:
        print(json.dumps(analysis.as_json()), file=stream)
    else:
        describe(analysis, stream)
    if config.png is not None:
        draw_png(topology, config.nodes, config.png)
        if not config.json:
            print(f"drawing        {config.png}", file=stream)
    return 0


def rounds_to_agree(analysis: Analysis) -> float:
    """Rounds of pure averaging to shrink the consensus distance by ``CONSENSUS_TARGET``."""
    if analysis.contraction <= 0:  # exact average after one period
        return float(analysis.period or 1)
    if analysis.contraction >= 1:
        return math.inf
    return math.ceil(math.log(CONSENSUS_TARGET) / math.log(analysis.contraction))


def describe(analysis: Analysis, stream: TextIO) -> None:
    lines = [
        f"topology       {analysis.name} on {analysis.nodes} nodes",
        f"edges          {analysis.edges} per round",
        f"degree         max {analysis.degree_max}, mean {analysis.degree_mean} (messages sent per round)",
        f"diameter       {analysis.diameter} hops",
        f"spectral gap   {analysis.spectral_gap:.4f} (1 - |lambda_2| of the mixing matrix)",
        f"contraction    {analysis.contraction:.4f} per round; {rounds_to_agree(analysis):g} "
        f"rounds to shrink disagreement {1 / CONSENSUS_TARGET:g}x",
        f"bytes/round    {analysis.bytes_per_round:,} per node at most",
    ]
    if analysis.period is None or analysis.period > 1:
        period = "random each round" if analysis.period is None else f"repeats every {analysis.period} rounds"
        lines.append(f"schedule       time-varying, {period}")
    stream.write("\n".join(lines) + "\n")


def compare(n: int, model_bytes: int, stream: TextIO) -> None:
    """One row per named topology (user files aside) for ``n`` nodes."""
    header = ["topology", "edges", "deg", "diam", "gap", "contr", "rounds", "bytes/round"]
    rows: list[list[str]] = []
    missing: list[str] = []
    for name in FAMILIES:
        if name == "file":
            continue
        try:
            a = analyze(Topology.parse(name), n, model_bytes)
        except TopologyError as exc:
            missing.append(f"{name}: not defined here ({exc})")
            continue
        rows.append(
            [
                name,
                str(a.edges),
                str(a.degree_max),
                str(a.diameter),
                f"{a.spectral_gap:.4f}",
                f"{a.contraction:.4f}",
                f"{rounds_to_agree(a):g}",
                f"{a.bytes_per_round:,}",
            ]
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    stream.write(
        f"{n} nodes, {model_bytes:,}-byte model; rounds: pure averaging rounds to shrink "
        f"disagreement {1 / CONSENSUS_TARGET:g}x\n"
    )
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        stream.write("  ".join(cells) + "\n")
    stream.write("".join(line + "\n" for line in missing))


def draw_png(topology: Topology, n: int, path: Path) -> None:
    """Draw round 0 of the topology: a torus on its grid, anything else on a circle."""
    import matplotlib  # here, not at the top: only --png needs it, and it is slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    graph = topology.graph(n, 0)
    analysis = analyze(topology, n)
    curved: list[tuple[int, int]] = []
    if topology.name == "torus":
        _, cols = torus_shape(n, dict(topology.params).get("rows", 0))
        positions = {v: (v % cols, -(v // cols)) for v in graph}
        curved = [(u, v) for u, v in graph.edges if abs(u % cols - v % cols) + abs(u // cols - v // cols) > 1]
    else:
        positions = nx.circular_layout(graph)
    figure, axes = plt.subplots(figsize=(6, 6))
    style = {"ax": axes, "edge_color": "#888888", "node_size": max(60, 400 - 4 * n)}
    straight = [e for e in graph.edges if e not in curved]
    nx.draw_networkx_edges(graph, positions, edgelist=straight, arrows=graph.is_directed(), **style)
    nx.draw_networkx_edges(  # the torus's wrap-around edges, bowed so they do not hide the grid
        graph,
        positions,
        edgelist=curved,
        arrows=True,
        arrowstyle="-",
        connectionstyle="arc3,rad=0.25",
        **style,
    )
    nx.draw_networkx_nodes(graph, positions, ax=axes, node_size=style["node_size"], node_color="#4c72b0")
    if n <= 64:
        nx.draw_networkx_labels(graph, positions, ax=axes, font_size=7, font_color="white")
    schedule = "" if analysis.period == 1 else " (round 0 of a time-varying schedule)"
    axes.set_title(
        f"{topology} on {n} nodes{schedule}\ndegree {analysis.degree_max}, "
        f"diameter {analysis.diameter}, spectral gap {analysis.spectral_gap:.3f}"
    )
    axes.set_axis_off()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)

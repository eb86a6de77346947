"""Synchronous allreduce against decentralized gossip, with one node slowed 1x, 2x, 4x and 8x.

One invocation runs, for each slowdown, the same task, model, per-example learning rate and node
count on every arm:

- ``ddp``: torch.distributed DistributedDataParallel, gloo backend (allreduce of gradients). The
  emulated compute stands for a forward and backward pass, with which DDP overlaps its
  allreduce (its buckets go out as backward produces them): a step lasts the longer of the two.
- each gossipmesh algorithm (``dpsgd``, ``sgp``, ``adpsgd``, any ``--algorithm`` spelling), as a
  real local mesh; ``default`` is what a user gets without ``--algorithm``, ``choco-int8`` CHOCO
  with int8 compression, ``local-steps`` DiLoCo-style local steps (``--local-steps 10``).

DDP always runs: each arm's time to the target is set against it at the same slowdown.

Every process uses one torch thread and the same step pacer: each step lasts at least
``--compute-ms`` (a sleep fills the rest) and the slowed node's steps last ``FACTOR`` times
longer, so 8 processes on 2 cores measure the algorithms, not the scheduler. Reported per arm:
wall time from the first step (of the last node to start) until every node reaches the target
held-out accuracy, the steps
and examples it took, final accuracy (lowest node, and the slowed node's), bytes sent per node,
the ratio of the time to DDP's, and the fast nodes' steps per second over the second half of the
run against the same arm's with no node slowed. A PNG shows the lowest node's accuracy against
wall time for every arm.

With ``--partition dirichlet:0.5`` every arm (DDP's ranks too) trains on the same label-skewed
shards. An arm ``ALGORITHM+qgm`` (``dpsgd+qgm``) puts the momentum on the model's movement,
mixing included, instead of on the local gradients (``--quasi-global-momentum``);
``ALGORITHM+mix-momentum`` (``adpsgd+mix-momentum``) mixes the nodes' momentum buffers along
with their parameters (``--mix-momentum``).

    python bench/stragglers.py [--nodes 8] [--slowdowns 1,2,4,8] [--target 0.95] [--png FILE]
                               [--partition iid|dirichlet:ALPHA] [--topology exponential]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from meshrun import quiet_mesh

from gossipmesh.daemon.pacing import StepPacer
from gossipmesh.tasks import IID, Batches, DataPartition, load_task
from p2p.address import free_ports

LR, MOMENTUM, BATCH, EVAL_INTERVAL_S = 0.05, 0.9, 32, 0.25


@dataclass
class Arm:
    name: str
    slowdown: float
    timelines: list[
        list[dict[str, Any]]
    ]  # per node: {"t", "step", "accuracy", "bytes_sent"}, t from the first step

    def time_to(self, target: float) -> float:
        """When the last node reached ``target`` (inf if some never did)."""
        return max(next((p["t"] for p in tl if p["accuracy"] >= target), math.inf) for tl in self.timelines)

    def at(self, t: float, key: str) -> list[float]:
        return [float(next((p[key] for p in reversed(tl) if p["t"] <= t), 0)) for tl in self.timelines]

    def fast_rate(self) -> float:
        """The median steps per second of the nodes not slowed (all but the last), over the
        second half of the run (start-up, which load stretches unevenly, left out)."""
        rates = []
        for tl in self.timelines[:-1] if self.slowdown > 1 else self.timelines:
            middle = next(p for p in tl if p["t"] >= tl[-1]["t"] / 2)
            rates.append((tl[-1]["step"] - middle["step"]) / max(tl[-1]["t"] - middle["t"], 1e-9))
        return statistics.median(rates)

    def lowest_accuracy(self) -> list[tuple[float, float]]:
        times = sorted({p["t"] for tl in self.timelines for p in tl})
        return [(t, min(self.at(t, "accuracy"))) for t in times]


# -- the DDP arm ---------------------------------------------------------------------------------


def ddp_worker(
    rank: int,
    nodes: int,
    port: int,
    duration: float,
    compute_ms: float,
    slowdown: float,
    partition: DataPartition,
    out: Any,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nodes)
    task = load_task("digits")
    model = torch.nn.parallel.DistributedDataParallel(task.model(seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    shard = task.shard(rank, nodes, partition=partition, seed=0)  # (the mesh's split, seed 0)
    pacer = StepPacer(compute_ms, slowdown if rank == nodes - 1 else 1.0)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    start = time.monotonic()
    timeline: list[dict[str, Any]] = []
    next_eval = 0.0
    for steps, (inputs, targets) in enumerate(Batches(shard, BATCH, seed=rank)):
        now = time.monotonic() - start
        if now >= next_eval and rank == 0:
            accuracy = task.evaluate(model.module).accuracy
            bytes_sent = int(steps * 2 * (nodes - 1) / nodes * model_bytes)  # ring allreduce per step
            timeline.append(
                {"t": round(now, 3), "step": steps, "accuracy": accuracy, "bytes_sent": bytes_sent}
            )
            next_eval += EVAL_INTERVAL_S
        if steps % 8 == 0:  # all ranks must stop at the same step: agree on it now and then
            stop = torch.tensor([now >= duration], dtype=torch.int32)
            dist.all_reduce(stop)
            if stop.item():
                break
        started = time.monotonic()
        loss = task.loss(model, inputs, targets)  # forward
        optimizer.zero_grad()
        loss.backward()  # (with DDP's allreduce)
        pacer.finish_step(started)  # the emulated compute, the allreduce overlapped with it
        optimizer.step()
    if rank == 0:
        out.send(timeline)
    dist.barrier()
    # Exit without tearing the process group down: torch 2.13's gloo group can deadlock in its
    # destructor (its worker thread waits for the GIL the joining thread holds).
    os._exit(0)


def run_ddp(
    nodes: int, duration: float, compute_ms: float, slowdown: float, partition: DataPartition = IID
) -> Arm:
    context = multiprocessing.get_context("fork")
    port = free_ports(1)[0]
    receive, send = context.Pipe(duplex=False)
    workers = [
        context.Process(
            target=ddp_worker, args=(rank, nodes, port, duration, compute_ms, slowdown, partition, send)
        )
        for rank in range(nodes)
    ]
    for worker in workers:
        worker.start()
    timeline = receive.recv()
    for worker in workers:
        worker.join()
    return Arm("ddp", slowdown, [timeline] * nodes)  # one model: every rank's timeline is rank 0's


# -- the gossip arms -----------------------------------------------------------------------------


QUASI_GLOBAL = "+qgm"  # an arm's suffix: the momentum on the model's movement (gossip.optim.quasi_global)
MIX_MOMENTUM = "+mix-momentum"  # an arm's suffix: momentum buffers mixed too (gossip.optim.momentum_mixing)
NAMED_ARMS = {  # arms that are not an --algorithm spelling
    "default": [],
    "choco-int8": ["--algorithm", "choco", "--compression", "int8"],
    "local-steps": ["--local-steps", "10"],
}


def run_gossip(
    name: str,
    topology: str,
    nodes: int,
    duration: float,
    compute_ms: float,
    slowdown: float,
    partition: DataPartition,
) -> Arm:
    algorithm = name.removesuffix(QUASI_GLOBAL).removesuffix(MIX_MOMENTUM)
    argv = ["--nodes", str(nodes), *NAMED_ARMS.get(algorithm, ["--algorithm", algorithm])]
    argv += ["--duration", f"{duration:g}"]
    argv += ["--topology", topology]
    argv += ["--compute-ms", f"{compute_ms:g}", "--lr", str(LR), "--batch-size", str(BATCH)]
    argv += ["--partition", str(partition)]
    momentum = ["--momentum", "0", "--quasi-global-momentum", str(MOMENTUM)]
    argv += momentum if name.endswith(QUASI_GLOBAL) else ["--momentum", str(MOMENTUM)]
    if name.endswith(MIX_MOMENTUM):
        argv.append("--mix-momentum")
    if slowdown > 1:
        argv += ["--slowdown", f"{nodes - 1}:{slowdown:g}"]
    report = quiet_mesh(argv)
    start = max(n["t_first_step"] for n in report["nodes"])  # from when the whole mesh trains
    timelines = [
        [{**p, "t": round(p["t"] - start, 3)} for p in n["timeline"] if p["t"] >= start]
        for n in report["nodes"]
    ]
    return Arm(name, slowdown, timelines)


# -- the table and the plot ----------------------------------------------------------------------


def table(arms: list[Arm], target: float, nodes: int) -> list[str]:
    width = max(8, *(len(a.name) for a in arms))
    lines = [f"{'slow':>5} {'arm':<{width}} {'to target s':>11} {'x DDP':>6} {'steps':>6} {'examples':>9} "
             f"{'final acc':>9} {'slowed':>6} {'MB/node':>8} {'fast/s':>6} {'x even':>6}"]  # fmt: skip
    ddp = {a.slowdown: a.time_to(target) for a in arms if a.name == "ddp"}
    even = {a.name: a.fast_rate() for a in arms if a.slowdown == 1}
    for arm in arms:
        t = arm.time_to(target)
        reached = math.isfinite(t)
        steps = arm.at(t, "step") if reached else []
        if arm.name == "ddp":
            examples = steps[0] * BATCH * nodes if steps else 0
        else:  # (a straggler's step count moves on by the rounds it skips; its batches do not)
            examples = sum(arm.at(t, "batches")) * BATCH if reached else 0
        ratio = ddp.get(arm.slowdown, math.nan) / t if reached else 0.0
        final = min(tl[-1]["accuracy"] for tl in arm.timelines if tl)
        mb = sum(arm.at(t, "bytes_sent")) / len(arm.timelines) / 1e6 if reached else math.nan
        lines.append(
            f"{arm.slowdown:>4g}x {arm.name:<{width}} {t if reached else math.inf:>11.2f} {ratio:>6.2f} "
            f"{(max(steps) if steps else 0):>6.0f} {examples:>9.0f} {final:>9.3f} "
            f"{arm.timelines[-1][-1]['accuracy']:>6.3f} {mb:>8.1f} {arm.fast_rate():>6.1f} "
            f"{arm.fast_rate() / even.get(arm.name, math.nan):>6.2f}"
        )
    return lines


def plot(arms: list[Arm], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slowdowns = sorted({a.slowdown for a in arms})
    figure, axes = plt.subplots(
        1, len(slowdowns), figsize=(4.5 * len(slowdowns), 4), sharey=True, squeeze=False
    )
    for ax, slowdown in zip(axes[0], slowdowns, strict=True):
        for arm in (a for a in arms if a.slowdown == slowdown):
            points = arm.lowest_accuracy()
            ax.plot([t for t, _ in points], [acc for _, acc in points], label=arm.name)
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"one node {slowdown:g}x slower")
        ax.set_xlabel("wall time from the first step (s)")
        ax.set_ylim(0.5, 1.0)
    axes[0][0].set_ylabel("held-out accuracy of the lowest node")
    axes[0][-1].legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--slowdowns", default="1,2,4,8", help="comma-separated factors for the slowed node")
    parser.add_argument(
        "--arms",
        default="default,dpsgd,sgp,adpsgd",
        help=f"gossipmesh algorithms ({', '.join(NAMED_ARMS)}, ALGORITHM+qgm, ALGORITHM+mix-momentum too); "
        "ddp always runs",
    )
    parser.add_argument("--target", type=float, default=0.95, help="held-out accuracy every node must reach")
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds each run trains")
    parser.add_argument("--png", type=Path, default=Path("bench-stragglers.png"))
    parser.add_argument(
        "--partition", type=DataPartition.parse, default=IID, help="iid, or dirichlet:ALPHA (label skew)"
    )
    parser.add_argument(
        "--topology", default="exponential", help="the gossip arms' topology (as mesh --topology)"
    )
    parser.add_argument("--json", type=Path, help="also write the timelines here")
    args = parser.parse_args()

    arms: list[Arm] = []
    names = ["ddp", *(name for name in args.arms.split(",") if name != "ddp")]
    for slowdown in (float(s) for s in args.slowdowns.split(",")):
        for name in names:
            run = run_ddp if name == "ddp" else lambda *a, name=name: run_gossip(name, args.topology, *a)
            started = time.monotonic()
            arms.append(run(args.nodes, args.duration, args.compute_ms, slowdown, args.partition))
            print(
                f"  {name} with one node {slowdown:g}x slower: {time.monotonic() - started:.0f} s", flush=True
            )
    print(
        f"\n{args.nodes} nodes, {args.compute_ms:g} ms per step, {args.partition} data, "
        f"gossip on {args.topology}, "
        f"target {args.target} for every node"
    )
    print("\n".join(table(arms, args.target, args.nodes)))
    plot(arms, args.target, args.png)
    print(f"plot: {args.png}")
    if args.json:
        args.json.write_text(json.dumps([a.__dict__ for a in arms]))


if __name__ == "__main__":
    main()

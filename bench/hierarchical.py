"""Machines of several GPUs: the hierarchical mesh against flat gossip and against DDP, on
namespace hosts (needs root), side by side in one run.

- ``hierarchical``: ``gossipmesh mesh --hosts netns --nodes M --local-ranks N``: M machines,
  gradients averaged over each machine's N ranks (gloo, over the host's loopback), rank r
  gossiping slice r of the model with rank r of the neighbouring machines (``--algorithm``:
  D-PSGD on a ring unless told).
- ``flat``: ``gossipmesh mesh --hosts netns --nodes M*N``: every device its own member, on a
  host of its own, as one runs gossip without local ranks.
- ``ddp``: M*N ranks of ``DistributedDataParallel`` (gloo), N on each of M hosts: the plain
  way to train one model on these devices.

Every arm trains the same wide MLP (``--width``: 64-W-W-10; 5000 is ~25M parameters, 100 MB)
for ``--steps`` steps of one batch per device, with ``--compute-ms`` standing for an
accelerator's step. Printed per arm: seconds per step (the median rank's steady rate), the
bytes every host sent on its link (its eth0 counter: what crossed between hosts, framing
included) in all and per step, and both against the flat mesh. One figure:

    sudo python bench/hierarchical.py [--machines 4] [--ranks 2] [--width 5000] [--steps 60]
                                      [--link MBPS] [--algorithm dpsgd]

``--link`` caps every host's uplink (``tc tbf``, as ``gossipmesh mesh --link`` does): where the
links, not the devices, set the pace.

``--shard`` compares, instead, the two ways a machine's ranks hold the model, side by side on the
same model (``--depth`` blocks of ``--width`` x ``--width``, AdamW): ``replica`` (every rank the
whole model, gradients averaged inside the machine, rank r gossiping slice r) and ``shard``
(FSDP2: rank r holds and gossips shard r, the model made on the meta device and never whole on a
rank). Every rank is a ``gossipmesh.Session`` on 127.0.0.1 (M machines of N forked ranks, no
root needed). Printed per arm and rank: the peak of its resident memory above where it started
(``VmHWM``), what it holds (parameters and optimizer state) and its seconds per step.
``--rank-memory-mb B`` gives every rank a budget the kernel enforces (``RLIMIT_DATA``: what the
rank may map beyond what it had started with, threads' stacks included): a model over the
budget fails to allocate in the replica arm and trains sharded. On 2 loaded CPU cores, 2
machines x 2 ranks, 16.9M parameters, 30 steps: the replica ranks peaked at 501-519 MB (202 MB
held), 2.25 s a step; the shard ranks at 343-345 MB (101 MB held: half the parameters and
AdamW state), 3.96 s a step (gloo all-gathers and reduce-scatters each block on the CPU; 2.44
s in a quieter run). With ``--rank-memory-mb 450`` the replica ranks failed (MemoryError) and
the shard ranks trained. (The accuracy it prints is chance for both arms: 30 steps of a deep
plain MLP; the arms compare memory and time.)

    python bench/hierarchical.py --shard --machines 2 [--ranks 2] [--width 1024] [--depth 16]
                                 [--steps 30] [--rank-memory-mb 450]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import resource
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from forked import run_forked
from meshrun import quiet_mesh
from wan_task import WIDTHS, WideDigits

import gossipmesh
from gossipmesh.daemon.pacing import StepPacer
from gossipmesh.mesh import netns
from gossipmesh.tasks import IID, Batches
from gossipmesh.tasks.digits import DigitsTask
from p2p.address import free_ports

BATCH = 32
LR = 0.05
MOMENTUM = 0.9  # every arm's optimizer: SGD with this momentum (the daemon's default)
PORT = 29400
_M_MMAP_THRESHOLD = -3  # mallopt's parameter


def gossip_arm(machines: int, ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    """One mesh run; its seconds per step and the bytes its hosts sent on their links."""
    report = quiet_mesh([
        "--hosts", "netns", "--nodes", str(machines), "--local-ranks", str(ranks),
        "--task", f"wan_task:width_{args.width}",
        "--steps", str(args.steps), "--compute-ms", f"{args.compute_ms:g}", "--lr", str(LR),
        "--momentum", str(MOMENTUM), "--batch-size", str(BATCH), "--insecure", "--plot", "none",
        "--eval-interval", "5", "--algorithm", args.algorithm,
        *(["--link", f"{args.link:g}"] if args.link else []),
    ])  # fmt: skip
    rates = [_seconds_per_step(node["timeline"]) for node in report["nodes"]]
    return {
        "s_per_step": statistics.median(rates),
        "wire_bytes": sum(report["links"]["wire_bytes_sent"].values()),
        "local_bytes": sum(node.get("bytes_local", 0) for node in report["nodes"]),
        "accuracy": min(node["final"]["accuracy"] for node in report["nodes"]),
    }


def _seconds_per_step(timeline: list[dict[str, Any]]) -> float:
    """The steady rate: from the first point past a quarter of the run to the last."""
    start, end = timeline[len(timeline) // 4], timeline[-1]
    return float(end["t"] - start["t"]) / max(int(end["step"] - start["step"]), 1)


def ddp_arm(machines: int, ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    """M*N DDP ranks on M namespace hosts; the same figures as :func:`gossip_arm`'s."""
    world = machines * ranks
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    with netns.lan(machines) as hosts:
        for host in hosts if args.link else []:
            netns.cap_bandwidth(host, f"{args.link:g}mbit")
        before = sum(netns.sent_bytes(h) for h in hosts)
        workers = [
            context.Process(
                target=_ddp_rank, args=(rank, world, hosts[rank // ranks], hosts[0].address, args, results)
            )
            for rank in range(world)
        ]
        for worker in workers:
            worker.start()
        outcomes = [results.get(timeout=3600) for _ in workers]
        for worker in workers:
            worker.join()
        wire = sum(netns.sent_bytes(h) for h in hosts) - before
    failures = [o for o in outcomes if isinstance(o, str)]
    if failures:
        raise RuntimeError(f"a DDP rank failed: {failures[0]}")
    return {
        "s_per_step": statistics.median(o["s_per_step"] for o in outcomes),
        "wire_bytes": wire,
        "local_bytes": 0,
        "accuracy": max(o["accuracy"] for o in outcomes),  # (rank 0's: the others report none)
    }


def _ddp_rank(
    rank: int, world: int, host: netns.Host, master: str, args: argparse.Namespace, results: Any
) -> None:
    try:
        netns.enter(host)
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # (the host name resolves to loopback here)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT}", rank=rank, world_size=world)
        task = WideDigits(args.width)
        model = torch.nn.parallel.DistributedDataParallel(task.model(seed=0))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        shard = task.shard(rank, world, partition=IID, seed=0)
        pacer = StepPacer(args.compute_ms, 1.0)
        times = []
        dist.barrier()
        for step, (inputs, targets) in enumerate(Batches(shard, BATCH, seed=rank)):
            if step == args.steps:
                break
            started = time.monotonic()
            loss = task.loss(model, inputs, targets)
            optimizer.zero_grad()
            pacer.finish_step(started)  # the emulated compute, before backward's allreduce
            loss.backward()
            optimizer.step()
            times.append(time.monotonic())
        steady = times[len(times) // 4 :]
        accuracy = task.evaluate(model.module).accuracy if rank == 0 else -1.0
        results.put({"s_per_step": (steady[-1] - steady[0]) / max(len(steady) - 1, 1), "accuracy": accuracy})
        dist.barrier()
    except BaseException as exc:
        results.put(f"rank {rank}: {type(exc).__name__}: {exc}")
    os._exit(0)  # (torch 2.13's gloo group can deadlock in its destructor; see bench/stragglers)


def shard_arms(args: argparse.Namespace) -> None:
    """``--shard``: the replica and the shard arm, side by side (see the module docstring)."""
    m, n = args.machines, args.ranks
    params = 64 * args.width + args.depth * (args.width + 1) * args.width + 10 * args.width
    budget = f", {args.rank_memory_mb:g} MB a rank" if args.rank_memory_mb else ""
    print(f"{m} machines x {n} ranks, {params / 1e6:.1f}M parameters (AdamW), {args.steps} steps{budget}")
    print(f"{'arm':<8} {'rank':>5} {'peak MB':>8} {'held MB':>8} {'s/step':>7}  outcome")
    for arm in ("replica", "shard"):
        ports = free_ports(m, block=n)  # (rank r of machine i on port i + r)
        masters = free_ports(m)
        places = [(r // n, r % n, arm == "shard", ports, masters, args) for r in range(m * n)]
        outcomes = run_forked(m * n, _shard_rank, places.__getitem__)
        for place, outcome in enumerate(outcomes):
            where = f"{place // n}.{place % n}"
            if isinstance(outcome, str):
                print(f"{arm:<8} {where:>5} {'-':>8} {'-':>8} {'-':>7}  failed: {outcome}")
                continue
            print(
                f"{arm:<8} {where:>5} {outcome['peak_mb']:>8.1f} {outcome['held_mb']:>8.1f} "
                f"{outcome['s_per_step']:>7.3f}  accuracy {outcome['accuracy']:.3f}"
            )


def _deep_model(width: int, depth: int) -> torch.nn.Module:
    """64 -> width, ``depth`` blocks of width x width, -> 10: FSDP gathers one block at a time."""
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(depth)]
    return torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.ReLU(), *blocks, torch.nn.Linear(width, 10)
    )


def _status(field: str) -> int:
    """A ``/proc/self/status`` size of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _shard_rank(
    machine: int,
    rank: int,
    shard: bool,
    ports: list[int],
    masters: list[int],
    args: argparse.Namespace,
    out: Connection,
) -> None:
    """Local rank ``rank`` of machine ``machine``: a Session as under torchrun; sends its figures."""
    outcome: dict[str, float] | str
    try:
        size = str(args.ranks)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=size, LOCAL_WORLD_SIZE=size)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(masters[machine]))
        torch.set_num_threads(1)
        # every large block mmapped and given back when freed: glibc's default raises its mmap
        # threshold to the largest block freed, and the heap then keeps freed blocks resident
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, 1 << 16)
        started = _status("VmRSS")
        if args.rank_memory_mb:  # (the kernel refuses what maps beyond it: the allocation fails)
            limit = _status("VmData") + int(args.rank_memory_mb * 1e6)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
        with torch.device("meta" if shard else "cpu"):
            model = _deep_model(args.width, args.depth)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        argv = ["--id", f"m{machine}", "--listen", f"tcp://127.0.0.1:{ports[machine]}", "--insecure"]
        argv += ["--expect", str(args.machines), "--algorithm", args.algorithm, "--startup-timeout", "60"]
        argv += ["--bootstrap", f"tcp://127.0.0.1:{ports[0]}"] if machine else []
        task = DigitsTask()
        with gossipmesh.Session(gossipmesh.node_config(argv, env={}), model, optimizer, shard=shard) as node:
            index, count = node.shard
            times = []
            batches = Batches(task.shard(index, count, partition=IID, seed=0), BATCH, seed=index)
            for step, (inputs, targets) in enumerate(batches):
                if step == args.steps:
                    break
                loss = task.loss(model, inputs, targets)
                node.optimizer.zero_grad()
                loss.backward()
                node.optimizer.step()
                times.append(time.monotonic())
            accuracy = task.evaluate(model).accuracy  # (sharded: a collective, every rank)
            footprint = node.optimizer.footprint()
        steady = times[len(times) // 4 :]
        outcome = {
            "peak_mb": (_status("VmHWM") - started) / 1e6,
            "held_mb": (footprint["parameter_bytes"] + footprint["optimizer_state_bytes"]) / 1e6,
            "s_per_step": (steady[-1] - steady[0]) / max(len(steady) - 1, 1),
            "accuracy": accuracy,
        }
    except BaseException as exc:
        outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
    out.send(outcome)
    os._exit(0)  # (a rank whose peer failed may hang in gloo's teardown)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--machines", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2, help="devices (local ranks) per machine")
    parser.add_argument(
        "--width",
        type=int,
        choices=WIDTHS,
        help="hidden width: 5000 (the default) is ~25M parameters; --shard: 1024",
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--compute-ms", type=float, default=100.0)
    parser.add_argument("--arms", default="hierarchical,flat,ddp")
    parser.add_argument(
        "--link", type=float, help="cap every host's uplink at this many Mbit/s (tc tbf; default: none)"
    )
    parser.add_argument(
        "--algorithm",
        default="dpsgd",
        help="the gossip arms' --algorithm (default: dpsgd on a ring; sgp sends to one peer a round)",
    )
    parser.add_argument(
        "--shard", action="store_true", help="compare the replica and the FSDP2 shard arms instead"
    )
    parser.add_argument("--depth", type=int, default=16, help="--shard: width x width blocks")
    parser.add_argument(
        "--rank-memory-mb", type=float, help="--shard: each rank's memory budget, enforced (RLIMIT_DATA)"
    )
    args = parser.parse_args()
    args.width = args.width or (1024 if args.shard else 5000)
    if args.shard:
        shard_arms(args)
        return
    if why := netns.unavailable():
        parser.error(f"namespace hosts: {why}")
    m, n = args.machines, args.ranks
    params = 64 * args.width + args.width * args.width + 10 * args.width
    print(f"{m} machines x {n} devices, {params / 1e6:.1f}M parameters, {args.steps} steps, {args.algorithm}")
    runs = {
        "hierarchical": lambda: gossip_arm(m, n, args),
        "flat": lambda: gossip_arm(m * n, 1, args),
        "ddp": lambda: ddp_arm(m, n, args),
    }
    rows = {arm: runs[arm]() for arm in args.arms.split(",")}
    flat = rows.get("flat")
    print(
        f"{'arm':<13} {'s/step':>7} {'x flat':>7} {'link MB':>9} {'MB/step':>8} {'x flat':>7} "
        f"{'local MB':>9} {'acc':>6}"
    )
    for arm, row in rows.items():
        speed = flat["s_per_step"] / row["s_per_step"] if flat else float("nan")
        share = row["wire_bytes"] / flat["wire_bytes"] if flat else float("nan")
        print(
            f"{arm:<13} {row['s_per_step']:>7.3f} {speed:>7.2f} {row['wire_bytes'] / 1e6:>9.1f} "
            f"{row['wire_bytes'] / args.steps / 1e6:>8.2f} {share:>7.3f} {row['local_bytes'] / 1e6:>9.1f} "
            f"{row['accuracy']:>6.3f}"
        )


if __name__ == "__main__":
    main()

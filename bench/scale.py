"""Gossip at 10M-1B parameters against a gloo allreduce of the same bytes, side by side.

For each model size (a wide MLP of linear layers in ``--dtype``), ``--nodes`` processes on
127.0.0.1 run each arm in turn, fresh processes per arm:

- ``allreduce``: ``torch.distributed.all_reduce`` of the model's flat vector over gloo, the
  standard way (what DDP does with every gradient): seconds per call.
- ``zmq-ring``: the D-PSGD ring round written with bare pyzmq, as a user would without
  gossipmesh: the flat vector sent whole to both ring neighbours (PUSH, ``copy=False``, tracked),
  theirs received (PULL, ``copy=False``), the three averaged with numpy in place once the sends
  have left. It moves D-PSGD's bytes through the same transport with nothing else: what the
  transport and the mix cost on their own.
- ``tcp-ring``: the same round over plain TCP sockets (one connection each way per neighbour,
  ``sendall`` from the vector and ``recv_into`` two buffers kept round after round, a thread
  per direction, the mix as above): what a ring of Python processes costs on this machine with
  no message layer at all, the floor under both.
- a gossip arm (``dpsgd``: D-PSGD on a ring; ``sgp``, ``adpsgd``, ``choco-int8``): every process
  a real node (``gossipmesh.connect``, ZeroMQ, --insecure) and a ``GossipOptimizer`` around SGD
  with zero gradients: seconds per ``step()``, which for the synchronous algorithms is one round
  (adpsgd's exchanges run beside the steps; its figure is a step's cost, and its memory is
  read once every node took part in ``EXCHANGES`` exchanges: its steps alone take no time).

Per arm: the median round over every process's timed rounds (after warm-up), the bytes a
process sent per timed round (at the socket; gloo's: what its ring moves, 2 (n - 1) / n of the
vector), and the peak memory each process added over its model and optimizer (VmHWM after the
peak is reset once the model and the local optimizer are built, before the node or the
allreduce's group is), against the model's bytes.

    python bench/scale.py [--params 10M,100M,1B] [--dtype float32|bfloat16] [--nodes 4] [--rounds 8]
                          [--arms allreduce,tcp-ring,dpsgd,...] [--mix-in-place]

``--mix-in-place``: the gossip arms mix in the model's own memory and dtype (a bfloat16 model's
float32 copy, twice its bytes, is what keeps four 1B-parameter nodes from fitting in 24 GiB).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import socket
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import zmq
from forked import run_forked

import gossipmesh
from gossipmesh.config import NodeConfig, load
from p2p.address import free_ports

WIDTH = 2048  # a layer of the benchmark MLP: WIDTH x WIDTH weights (4.2M parameters)
WARMUP = 2
EXCHANGES = 4  # AD-PSGD exchanges each node takes part in before its memory is read
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GOSSIP_ARMS = {
    "dpsgd": {"algorithm": "dpsgd", "topology": "ring"},
    "sgp": {"algorithm": "sgp"},
    "adpsgd": {"algorithm": "adpsgd"},
    "choco-int8": {"algorithm": "choco", "compression": "int8"},
}


def wide_mlp(params: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Linear layers of WIDTH x WIDTH (the last one narrower) holding about ``params`` weights."""
    layers, left = [], params
    while left > 0:
        rows = min(WIDTH, max(1, left // WIDTH))
        layers.append(torch.nn.Linear(WIDTH, rows, bias=False, dtype=dtype))
        left -= rows * WIDTH
    return torch.nn.Sequential(*layers)


def rss(field: str) -> int:
    """This process's memory figure ``field`` of /proc/self/status (VmRSS:, VmHWM:), in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field))) * 1024


def reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS (Linux: clear_refs 5); the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss("VmRSS:")


def _run_arm(arm: str, rank: int, nodes: int, params: int, dtype: torch.dtype, rounds: int,
             in_place: bool, ports: list[int], barrier: Barrier, out: Connection) -> None:  # fmt: skip
    logging.disable(logging.WARNING)  # every node of every arm would say it runs --insecure
    torch.set_num_threads(1)  # the processes share the cores (torchrun sets OMP_NUM_THREADS=1 so too)
    torch.manual_seed(0)
    model = wide_mlp(params, dtype)
    size = sum(p.numel() for p in model.parameters())
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if arm == "allreduce":
        base = reset_peak()  # (the flat vector counts, as DDP's gradient buckets would)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=nodes
        )
        vector = _flat(model)

        def one_round() -> None:
            dist.all_reduce(vector)

        def sent() -> int:  # a ring allreduce: reduce-scatter, then all-gather
            return 2 * (nodes - 1) * vector.numel() * itemsize // nodes
    elif arm in ("zmq-ring", "tcp-ring"):
        base = reset_peak()
        ring = _zmq_ring if arm == "zmq-ring" else _tcp_ring
        one_round, sent = ring(_flat(model).numpy(), rank, nodes, ports)
    else:
        flags = {"insecure": True, "listen": f"tcp://127.0.0.1:{ports[rank]}", "expect": str(nodes),
                 "id": f"node-{rank}", **({"bootstrap": [f"tcp://127.0.0.1:{ports[0]}"]} if rank else {}),
                 "mix_in_place": in_place, **GOSSIP_ARMS[arm]}  # fmt: skip
        config = load(NodeConfig, flags)
        local = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
        base = reset_peak()  # (what gossip holds from here on counts: a float32 copy of the model too)
        peer = gossipmesh.connect(config, model)
        optimizer = config.gossip_optimizer(local, peer)

        def one_round() -> None:
            optimizer.step()

        def sent() -> int:
            return peer.stats.bytes_sent

    times = []
    for index in range(WARMUP + rounds):
        if index == WARMUP:
            barrier.wait()
            sent_before = sent()
        started = time.perf_counter()
        one_round()
        if index >= WARMUP:
            times.append(time.perf_counter() - started)
    if arm == "adpsgd":  # its steps take no time: the peak counts once exchanges were made
        _step_until_exchanged(optimizer, EXCHANGES)
    barrier.wait()
    sent_per_round = (sent() - sent_before) / rounds if arm != "allreduce" else sent()
    added = rss("VmHWM:") - base
    if arm in GOSSIP_ARMS:
        optimizer.close()
        peer.leave(after_round=optimizer.round - 1)
        barrier.wait()  # nobody leaves while a neighbour still waits for its last round
        peer.close()
    out.send({"times": times, "added_bytes": added, "model_bytes": itemsize * size, "sent": sent_per_round})


def _step_until_exchanged(optimizer: Any, exchanges: int) -> None:
    """Step (untimed) until AD-PSGD's exchanger made or answered ``exchanges`` exchanges."""
    deadline = time.monotonic() + 120
    while optimizer.averager.exchanges < exchanges:
        if time.monotonic() > deadline:
            raise RuntimeError(f"adpsgd: {optimizer.averager.exchanges} exchanges in 120 s")
        optimizer.step()
        time.sleep(0.01)


def _zmq_ring(
    vector: np.ndarray, rank: int, nodes: int, ports: list[int]
) -> tuple[Callable[[], None], Callable[[], int]]:
    """One round and the bytes sent so far of the bare-pyzmq ring arm (see the module docstring)."""
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(f"tcp://127.0.0.1:{ports[rank]}")
    outboxes = []
    for neighbour in _ring_neighbours(rank, nodes):
        outbox = context.socket(zmq.PUSH)
        outbox.connect(f"tcp://127.0.0.1:{ports[neighbour]}")
        outboxes.append(outbox)
    early: dict[int, list[zmq.Frame]] = {}  # a faster neighbour's values of rounds to come
    state = {"round": 0, "sent": 0}

    def one_round() -> None:
        number = state["round"]
        tag = number.to_bytes(8, "little")
        trackers = [outbox.send_multipart([tag, vector], copy=False, track=True) for outbox in outboxes]
        state["sent"] += len(outboxes) * vector.nbytes
        values = early.pop(number, [])
        while len(values) < len(outboxes):
            got_tag, payload = inbox.recv_multipart(copy=False)
            got = int.from_bytes(got_tag.bytes, "little")
            (values if got == number else early.setdefault(got, [])).append(payload)
        for tracker in trackers:
            tracker.wait()  # the vector is written below: ZeroMQ must have let go of it
        _average_in_place(vector, [np.frombuffer(payload.buffer, dtype=vector.dtype) for payload in values])
        state["round"] += 1

    return one_round, lambda: state["sent"]


def _flat(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters as one flat vector (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ring_neighbours(rank: int, nodes: int) -> list[int]:
    return sorted({(rank - 1) % nodes, (rank + 1) % nodes} - {rank})


def _average_in_place(vector: np.ndarray, values: list[np.ndarray]) -> None:
    """vector <- the mean of itself and ``values`` (the ring arms' mix)."""
    for value in values:
        np.add(vector, value, out=vector)
    np.divide(vector, len(values) + 1, out=vector)


def _tcp_ring(
    vector: np.ndarray, rank: int, nodes: int, ports: list[int]
) -> tuple[Callable[[], None], Callable[[], int]]:
    """One round and the bytes sent so far of the plain-socket ring arm (the module docstring)."""
    neighbours = _ring_neighbours(rank, nodes)
    listener = socket.create_server(("127.0.0.1", ports[rank]), backlog=len(neighbours))
    outgoing = [_connect(ports[neighbour]) for neighbour in neighbours]
    incoming = [listener.accept()[0] for _ in neighbours]  # (which is whose does not matter)
    listener.close()
    received = [np.empty_like(vector) for _ in neighbours]
    workers = ThreadPoolExecutor(len(outgoing) + len(incoming))
    state = {"sent": 0}

    def one_round() -> None:
        payload = memoryview(vector).cast("B")
        transfers = [workers.submit(connection.sendall, payload) for connection in outgoing]
        transfers += [
            workers.submit(_receive_into, connection, memoryview(buffer).cast("B"))
            for connection, buffer in zip(incoming, received, strict=True)
        ]
        for transfer in transfers:
            transfer.result()  # (the sends have left the vector: it is written below)
        state["sent"] += len(outgoing) * vector.nbytes
        _average_in_place(vector, received)

    return one_round, lambda: state["sent"]


def _connect(port: int) -> socket.socket:
    """A connection to the neighbour listening on ``port`` (it may not listen yet)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            connection = socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return connection


def _receive_into(connection: socket.socket, buffer: memoryview) -> None:
    while buffer:
        got = connection.recv_into(buffer)
        if not got:
            raise ConnectionError("a ring neighbour closed its connection")
        buffer = buffer[got:]


def run_arm(
    arm: str, nodes: int, params: int, dtype: torch.dtype, rounds: int, in_place: bool = False
) -> dict[str, Any]:
    barrier = multiprocessing.get_context("fork").Barrier(nodes)
    ports = free_ports(nodes)
    results = run_forked(
        nodes, _run_arm, lambda rank: (arm, rank, nodes, params, dtype, rounds, in_place, ports, barrier)
    )
    times = [t for r in results for t in r["times"]]
    return {
        "arm": arm,
        "params": params,
        "model_bytes": results[0]["model_bytes"],
        "round_s_median": statistics.median(times),
        "round_s_min": min(times),
        "round_s_max": max(times),
        "added_bytes_max": max(r["added_bytes"] for r in results),
        "sent_bytes_per_round": statistics.median(r["sent"] for r in results),
    }


def parse_count(text: str) -> int:
    """A parameter count: 25M, 1B (or 1G), 2.5K, 1000."""
    units = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}
    try:
        return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1:].upper() in units else int(text)
    except ValueError:
        raise SystemExit(f"--params: {text!r} is not a count like 25M or 1B") from None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--params", default="10M,100M", help="model sizes, e.g. 25M,100M,1B (default: 10M,100M)"
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="the model's dtype (default: float32)"
    )
    parser.add_argument("--nodes", type=int, default=4, help="processes (default: 4)")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per arm (default: 8)")
    parser.add_argument(
        "--arms",
        default="allreduce,tcp-ring,zmq-ring,dpsgd,sgp,adpsgd,choco-int8",
        help="arms, in order",
    )
    parser.add_argument(
        "--mix-in-place", action="store_true", help="gossip arms mix in the model's memory and dtype"
    )
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    dtype = DTYPES[args.dtype]
    print(f"{'params':>8} {'MB':>6} {'arm':>11} {'round s':>8} {'min':>7} {'max':>7} {'vs allreduce':>13} "
          f"{'sent MB':>8} {'added MB':>9} {'x model':>8}", flush=True)  # fmt: skip
    for params in map(parse_count, args.params.split(",")):
        reference = None
        for arm in args.arms.split(","):
            row = run_arm(arm, args.nodes, params, dtype, args.rounds, args.mix_in_place)
            rows.append(row)
            reference = row["round_s_median"] if arm == "allreduce" else reference
            ratio = f"{row['round_s_median'] / reference:.2f}x" if reference else "-"
            added = row["added_bytes_max"]
            print(
                f"{params / 1e6:>7.0f}M {row['model_bytes'] / 1e6:>6.0f} {arm:>11} "
                f"{row['round_s_median']:>8.3f} {row['round_s_min']:>7.3f} {row['round_s_max']:>7.3f} "
                f"{ratio:>13} {row['sent_bytes_per_round'] / 1e6:>8.0f} {added / 1e6:>9.0f} "
                f"{added / row['model_bytes']:>8.2f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Throughput of gossipmesh's transport against bare pyzmq, side by side in one run.

Two processes on 127.0.0.1 move a flat float32 parameter vector (100 MB and 1 GB by default):

- ``bare``: a DEALER sends ``[header, payload]`` with ``copy=False`` to a ROUTER that receives
  with ``copy=False``: the floor of what ZeroMQ costs.
- ``gossipmesh``: two ``p2p.Transport`` objects, as in two daemons: encode (zero-copy), the
  network thread, ZeroMQ, decode and validation on the receiver's network thread, the inbox.
  Vectors above 4 MiB go as streams of 4 MiB chunks, reassembled as they arrive.

Each timed run sends ``--messages`` vectors and waits for the receiver's one-byte ack, so the
time covers delivery to the receiving application. Arms alternate; the median run is reported.

Peak memory of each process is reported against the vector's size.

    python bench/transport.py [--sizes-mb 100,1000] [--messages 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import zmq

from p2p import Transport
from p2p.address import free_ports
from p2p.wire import Limits


def bare_receiver(address: str, total: int, control: Connection) -> None:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(address)
    control.send("ready")
    while control.recv() == "go":
        for _ in range(total):
            identity, *_ = router.recv_multipart(copy=False)
        router.send_multipart([identity.bytes, b"!"])
    control.send(peak_rss())


def bare_sender(dealer: zmq.Socket[bytes], payload: np.ndarray, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        dealer.send_multipart([b"header", payload], copy=False)
    dealer.recv()
    return time.perf_counter() - started


def mesh_receiver(address: str, sender: str, total: int, nbytes: int, control: Connection) -> None:
    transport = Transport("receiver", address, inbox_kinds={"params"}, limits=Limits(nbytes))
    transport.start()
    while (ping := transport.recv(60.0)) is not None and ping.round == 0:  # until the sender hears us
        transport.send(sender, "ack", 0)
    control.send("ready")
    while control.recv() == "go":
        for _ in range(total):
            while transport.recv(60.0) is None:
                pass
        transport.send(sender, "ack", 0)
    control.send(peak_rss())


def connect(transport: Transport, receiver: str) -> None:
    """Ping until the receiver answers: a new ZeroMQ connection drops what is sent before it is up."""
    while transport.recv(0.05) is None:
        transport.send(receiver, "params", 0, [np.zeros(1, np.float32)])
    transport.send(receiver, "params", 1, [np.zeros(1, np.float32)])  # round 1: connected
    while transport.recv(0.05) is not None:
        pass


def mesh_sender(transport: Transport, receiver: str, payload: np.ndarray, count: int) -> float:
    started = time.perf_counter()
    for r in range(count):
        transport.send(receiver, "params", r, [payload])
    while transport.recv(60.0) is None:
        pass
    return time.perf_counter() - started


def peak_rss() -> int:
    """This process's peak resident memory, in bytes (VmHWM: unlike ru_maxrss, it is not
    inherited from the parent of a spawned process)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def measure(size_mb: float, messages: int, repeats: int) -> dict[str, float]:
    """Both arms for one vector size, with fresh receivers; GB/s and peak memory / size."""
    payload = np.random.default_rng(0).standard_normal(int(size_mb * 1e6) // 4, dtype=np.float32)
    spawn = multiprocessing.get_context("spawn")
    bare_at, mesh_at, sender_at = (f"tcp://127.0.0.1:{p}" for p in free_ports(3))
    bare_control, bare_remote = spawn.Pipe()
    mesh_control, mesh_remote = spawn.Pipe()
    receivers = [
        spawn.Process(target=bare_receiver, args=(bare_at, messages, bare_remote), daemon=True),
        spawn.Process(
            target=mesh_receiver,
            args=(mesh_at, sender_at, messages, payload.nbytes, mesh_remote),
            daemon=True,
        ),
    ]
    for process in receivers:
        process.start()
    sender = Transport("sender", sender_at, inbox_kinds={"ack"})
    sender.start()
    connect(sender, mesh_at)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(bare_at)
    assert bare_control.recv() == "ready" and mesh_control.recv() == "ready"

    times: dict[str, list[float]] = {"bare": [], "gossipmesh": []}
    for repeat in range(repeats + 1):  # the first round of each arm warms up connections
        bare_control.send("go")
        bare = bare_sender(dealer, payload, messages)
        mesh_control.send("go")
        mesh = mesh_sender(sender, mesh_at, payload, messages)
        if repeat:
            times["bare"].append(bare)
            times["gossipmesh"].append(mesh)
    bare_control.send("stop")
    mesh_control.send("stop")
    figures = {
        f"{arm} GB/s": payload.nbytes * messages / statistics.median(t) / 1e9 for arm, t in times.items()
    }
    figures["bare receiver peak / size"] = bare_control.recv() / payload.nbytes
    figures["gossipmesh receiver peak / size"] = mesh_control.recv() / payload.nbytes
    figures["sender peak / size"] = peak_rss() / payload.nbytes
    sender.close()
    dealer.close(linger=0)
    for process in receivers:
        process.join(10)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes-mb", default="100,1000", help="vector sizes in MB (10^6 bytes), comma-separated"
    )
    parser.add_argument("--messages", type=int, default=3, help="vectors per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per arm")
    args = parser.parse_args()

    runs = f"{args.messages} per run, median of {args.repeats} runs"
    print(f"moving a float32 vector over tcp://127.0.0.1, {runs};")
    print("peak memory is each process's peak resident set over the vector's size (the sender's")
    print("includes both arms; a receiver's includes its Python, numpy and ZeroMQ)")
    print(f"{'MB':>6} {'bare GB/s':>10} {'gossipmesh GB/s':>16} {'ratio':>6} {'bare rx mem':>12} "
          f"{'gossipmesh rx mem':>18} {'tx mem':>7}")  # fmt: skip
    for size in (float(s) for s in args.sizes_mb.split(",")):
        f = measure(size, args.messages, args.repeats)
        print(
            f"{size:>6g} {f['bare GB/s']:>10.2f} {f['gossipmesh GB/s']:>16.2f} "
            f"{f['gossipmesh GB/s'] / f['bare GB/s']:>6.2f} {f['bare receiver peak / size']:>11.2f}x "
            f"{f['gossipmesh receiver peak / size']:>17.2f}x {f['sender peak / size']:>6.2f}x",
            flush=True,
        )
    print("targets: ratio >= 0.8; peak memory of each process < 3x the vector")


if __name__ == "__main__":
    main()

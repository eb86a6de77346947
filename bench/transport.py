"""Throughput of gossipmesh's transport against bare pyzmq, side by side in one run.

Two processes on 127.0.0.1 move a flat float32 parameter vector (100 MB by default):

- ``bare``: a DEALER sends ``[header, payload]`` with ``copy=False`` to a ROUTER that receives
  with ``copy=False``: the floor of what ZeroMQ costs.
- ``gossipmesh``: two ``p2p.Transport`` objects, as in two daemons: encode (zero-copy), the
  network thread, ZeroMQ, decode and validation on the receiver's network thread, the inbox.

Each timed run sends ``--messages`` vectors and waits for the receiver's one-byte ack, so the
time covers delivery to the receiving application. Arms alternate; the median run is reported.

    python bench/transport.py [--size-mb 100] [--messages 5] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np
import zmq

from p2p import Transport
from p2p.wire import Limits
from runtime.launcher import free_ports


def bare_receiver(address: str, total: int, control: Connection) -> None:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(address)
    control.send("ready")
    while control.recv() == "go":
        for _ in range(total):
            identity, *_ = router.recv_multipart(copy=False)
        router.send_multipart([identity.bytes, b"!"])


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=float, default=100.0, help="vector size in MB (10^6 bytes)")
    parser.add_argument("--messages", type=int, default=5, help="vectors per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per arm")
    args = parser.parse_args()

    payload = np.random.default_rng(0).standard_normal(int(args.size_mb * 1e6) // 4).astype(np.float32)
    spawn = multiprocessing.get_context("spawn")
    bare_at, mesh_at, sender_at = (f"tcp://127.0.0.1:{p}" for p in free_ports(3))
    bare_control, bare_remote = spawn.Pipe()
    mesh_control, mesh_remote = spawn.Pipe()
    receivers = [
        spawn.Process(target=bare_receiver, args=(bare_at, args.messages, bare_remote), daemon=True),
        spawn.Process(
            target=mesh_receiver,
            args=(mesh_at, sender_at, args.messages, payload.nbytes, mesh_remote),
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

    times: dict[str, list[float]] = {"bare pyzmq": [], "gossipmesh": []}
    for repeat in range(args.repeats + 1):  # the first round of each arm warms up connections
        bare_control.send("go")
        bare = bare_sender(dealer, payload, args.messages)
        mesh_control.send("go")
        mesh = mesh_sender(sender, mesh_at, payload, args.messages)
        if repeat:
            times["bare pyzmq"].append(bare)
            times["gossipmesh"].append(mesh)
    bare_control.send("stop")
    mesh_control.send("stop")
    sender.close()
    dealer.close(linger=0)

    moved = payload.nbytes * args.messages
    print(f"moving a {payload.nbytes / 1e6:.0f} MB float32 vector over tcp://127.0.0.1, "
          f"{args.messages} per run, median of {args.repeats} runs")  # fmt: skip
    print(f"{'arm':<12} {'GB/s':>7} {'s per vector':>13}")
    rates = {}
    for arm, samples in times.items():
        median = statistics.median(samples)
        rates[arm] = moved / median / 1e9
        print(f"{arm:<12} {rates[arm]:7.2f} {median / args.messages:13.3f}")
    print(f"ratio gossipmesh / bare: {rates['gossipmesh'] / rates['bare pyzmq']:.2f} (target >= 0.8)")


if __name__ == "__main__":
    main()

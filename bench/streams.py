"""What ``--streams K`` (a large message's chunks spread over K connections) does to the rate at
which one node's model reaches another, side by side with one connection, on namespace hosts.

Two hosts on one bridge (needs root): a receiver ``p2p.Transport`` on one, a sender with
``streams=1`` or ``streams=K`` on the other, its uplink capped with ``tc tbf`` (or not). Each arm
sends a warm-up message (so every connection is up), then ``--messages`` float32 vectors of
``--size-mb``; the time runs from the first send until the receiver holds the last one whole.

    sudo python bench/streams.py [--links 100,1000,none] [--streams 4] [--size-mb 64] [--messages 4]

This machine cannot emulate latency (no netem): a tbf link has no round trip for one TCP
stream's window to fall short of, so K connections can only show what they cost here; where they
pay is a long link (100 ms at 1 Gbit/s needs 12.5 MB in flight).
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from multiprocessing.connection import Connection

import numpy as np

from gossipmesh.mesh import netns
from p2p import Transport
from p2p.wire import Limits

PORT = 7000


def receive(host: netns.Host, count: int, nbytes: int, control: Connection) -> None:
    """Take the warm-up message, say so, take ``count`` more; report when the last was whole."""
    netns.enter(host)
    transport = Transport(
        "receiver", f"tcp://{host.address}:{PORT}", inbox_kinds={"params"}, limits=Limits(nbytes)
    )
    transport.start()
    control.send("ready")
    try:
        for i in range(count + 1):
            if transport.recv(120, {"params"}) is None:
                control.send(None)
                return
            if i == 0:
                control.send("warm")
        control.send(time.monotonic())
    finally:
        transport.close()


def send(host: netns.Host, to: str, streams: int, count: int, nbytes: int, control: Connection) -> None:
    netns.enter(host)
    transport = Transport("sender", f"tcp://{host.address}:{PORT}", streams=streams)
    transport.start()
    vector = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    try:
        transport.send(to, "params", 0, [vector], member=True)
        control.recv()  # the warm-up arrived: every connection is up
        control.send(time.monotonic())
        for round in range(1, count + 1):
            transport.send(to, "params", round, [vector], member=True)
        control.recv()  # done: the sender may close
    finally:
        transport.close()


def run_arm(hosts: list[netns.Host], streams: int, count: int, nbytes: int) -> float | None:
    """Mbit/s at which ``count`` vectors went from host 0 to host 1 with ``streams`` connections."""
    context = multiprocessing.get_context("fork")
    to_receiver, receiver_end = context.Pipe()
    to_sender, sender_end = context.Pipe()
    receiver = context.Process(target=receive, args=(hosts[1], count, nbytes, receiver_end))
    receiver.start()
    to_receiver.recv()  # bound
    sender = context.Process(
        target=send, args=(hosts[0], f"tcp://{hosts[1].address}:{PORT}", streams, count, nbytes, sender_end)
    )
    sender.start()
    try:
        if to_receiver.recv() != "warm":
            return None
        to_sender.send("go")
        started = to_sender.recv()
        finished = to_receiver.recv()
        to_sender.send("done")
        if finished is None:
            return None
        return count * nbytes * 8 / (finished - started) / 1e6
    finally:
        for process in (sender, receiver):
            process.join(30)
            if process.is_alive():
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--links", default="100,1000,none", help="uplink caps in Mbit/s, or none")
    parser.add_argument("--streams", type=int, default=4, help="K of the arm beside one connection")
    parser.add_argument("--size-mb", type=float, default=64.0)
    parser.add_argument("--messages", type=int, default=4)
    args = parser.parse_args()
    why = netns.unavailable()
    if why is not None:
        raise SystemExit(f"bench/streams.py needs namespace hosts: {why}")
    nbytes = int(args.size_mb * 2**20) // 4 * 4
    print(f"{args.messages} messages of {args.size_mb:g} MB from one namespace host to another\n")
    print(f"| uplink | 1 connection, Mbit/s | {args.streams} connections, Mbit/s | ratio |")
    print("|---|---|---|---|")
    for link in args.links.split(","):
        with netns.lan(2) as hosts:
            if link != "none":
                netns.cap_bandwidth(hosts[0], f"{float(link):g}mbit")
            one, many = (run_arm(hosts, k, args.messages, nbytes) for k in (1, args.streams))
        ratio = f"{many / one:.2f}" if one and many else "-"
        shown = f"{link} Mbit/s" if link != "none" else "uncapped veth"
        print(f"| {shown} | {one or 0:.0f} | {many or 0:.0f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()

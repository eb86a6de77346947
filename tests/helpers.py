"""Shared test helpers: local meshes of real peers (threads in this process, or processes)."""

from __future__ import annotations

import importlib.util
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import zmq

from gossip import Algorithm, Codec, PeerNetwork
from gossip.algorithms import averager as averager_module
from gossip.algorithms import sgp as sgp_module
from gossip.algorithms.averager import Averager, RoundStats
from p2p import Peer, Transport
from p2p.address import free_ports
from topologies import Topology

HANG_S = 600.0
"""How long a test waits for what must happen before it calls the product hung. Only a hang
reaches it: it bounds no speed (a loaded machine may take minutes where a quiet one takes a
second); speed targets are measured by bench/ scripts."""


def addresses(count: int) -> list[str]:
    return addresses_of(free_ports(count))


def addresses_of(ports: list[int]) -> list[str]:
    return [f"tcp://127.0.0.1:{port}" for port in ports]


@contextmanager
def started_peers(ids: list[str], expect: int | None = None, **options: Any) -> Iterator[list[Peer]]:
    """Real peers on 127.0.0.1 (``Peer``'s ``options``) joining through the first one; waits
    until each sees ``expect`` members (default: all of them)."""
    listen = addresses(len(ids))
    peers = [
        Peer(node_id, address, listen[:1] if i else [], **options)
        for i, (node_id, address) in enumerate(zip(ids, listen, strict=True))
    ]
    try:
        for peer in peers:
            peer.start()
        for peer in peers:
            peer.wait_ready(HANG_S, expect=expect or len(ids))
        yield peers
    finally:
        for peer in peers:
            peer.close()


def average_in_threads(
    peers: Sequence[PeerNetwork],
    vectors: list[np.ndarray],
    *,
    topology: str,
    rounds: int,
    timeout: float = 5.0,
    history: list[list[np.ndarray]] | None = None,
    stats: list[list[RoundStats]] | None = None,
    algorithm: str | Sequence[str] = "dpsgd",
    compression: str = "none",
) -> list[list[float]]:
    """Run ``rounds`` rounds of pure averaging (no training) on every peer at once; returns
    round durations. Each wait for a neighbour lasts up to ``timeout`` (:func:`full_waits`).
    With ``history``, node i's vector after each round is appended to ``history[i]``; with
    ``stats``, what each round of node i mixed to ``stats[i]``.
    ``algorithm`` is every node's, or a list of each node's; one that takes ``stragglers=``
    and leaves it unset waits for every neighbour (``wait``), as :func:`full_waits` does."""
    durations: list[list[float]] = [[] for _ in peers]
    errors: list[BaseException] = []
    names = [algorithm] * len(peers) if isinstance(algorithm, str) else algorithm
    specs = [waiting(Algorithm.parse(name)) for name in names]

    def run(i: int, averager: Averager) -> None:
        try:
            for _ in range(rounds):
                started = time.monotonic()
                round_stats = averager.after_step()
                durations[i].append(time.monotonic() - started)
                if stats is not None and round_stats is not None:
                    stats[i].append(round_stats)
                if history is not None:
                    history[i].append(vectors[i].copy())
            averager.close()
        except BaseException as exc:  # surfaced in the test thread below
            errors.append(exc)

    with full_waits():
        # every node is built before any begins, so they start in step (a node built late would
        # find shares of rounds it has not reached)
        averagers = [
            spec.build(
                peer,
                vector,
                topology=Topology.parse(topology),
                round_timeout=timeout,
                lock=None,
                codec=Codec.parse(compression),
            )
            for spec, peer, vector in zip(specs, peers, vectors, strict=True)
        ]
        run_together(partial(run, i, averager) for i, averager in enumerate(averagers))
    if errors:
        raise errors[0]
    return durations


def waiting(spec: Algorithm) -> Algorithm:
    """``spec`` with ``stragglers=wait`` where it takes that option and leaves it unset: a test
    of the math must see every value of every round, even one a busy machine delayed (tolerant,
    a node would pass a descheduled neighbour over, or hold a value back from a busy link)."""
    if "stragglers" not in spec.family.params.accepted or "stragglers" in spec.options:
        return spec
    return Algorithm(spec.name, tuple(sorted({**spec.options, "stragglers": "wait"}.items())))


@contextmanager
def full_waits() -> Iterator[None]:
    """Averagers made inside wait up to their round timeout for every neighbour (their
    shortening of the wait to a multiple of recent round times is off), and SGP holds every
    share of the rounds ahead for its round, however many models they add up to: a thread
    descheduled on a busy machine neither misses a round of a test that checks the math
    exactly, nor has the shares of the others, up to three rounds ahead of it meanwhile on the
    one-peer exponential graph, mixed into its rounds as they come."""
    with (
        mock.patch.object(averager_module, "MIN_WAIT_S", math.inf),
        mock.patch.object(sgp_module, "HOLD_MODELS", math.inf),
    ):
        yield


def run_together(targets: Iterable[Callable[[], object]]) -> None:
    """Run each target on a thread of its own (nodes of an in-memory mesh) and wait for all."""
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def idle_peer(node_id: str, listen: str, bootstrap: list[str]) -> None:
    """A peer that joins and then only answers membership (run in a child process)."""
    peer = Peer(node_id, listen, bootstrap)
    peer.start()
    while True:
        time.sleep(1)


def echo_peer(node_id: str, listen: str) -> None:
    """Answers every tensor with the same tensor doubled (run in a child process)."""
    transport = Transport(node_id, listen, inbox_kinds={"params"})
    transport.start()
    while True:
        message = transport.recv(1.0)
        if message is not None:
            reply_to = str(message.meta["reply_to"])
            transport.send(reply_to, "params", message.round, [message.tensors[0] * 2])


@contextmanager
def raw_dealer(routing_id: bytes, address: str) -> Iterator[zmq.Socket[bytes]]:
    """A bare ZeroMQ DEALER connected to ``address``: sends whatever a test wants, no codec."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, routing_id)
    dealer.connect(address)
    try:
        yield dealer
    finally:
        dealer.close(0)
        context.term()


@contextmanager
def started_transport(node_id: str, **options: Any) -> Iterator[Transport]:
    transport = Transport(node_id, "tcp://127.0.0.1:0", **options)
    transport.start()
    try:
        yield transport
    finally:
        transport.close()


@contextmanager
def in_background(step: Callable[[], object]) -> Iterator[None]:
    """Call ``step`` every 10 ms on a thread until the block ends (as a node does between its
    training steps)."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(0.01):
            step()

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def wait_until(condition: Callable[[], bool], timeout: float = HANG_S, interval: float = 0.02) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` s pass (its last answer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def peak_memory() -> int:
    """This process's peak resident memory in bytes (VmHWM: unlike ru_maxrss, not inherited
    from the parent of a spawned process)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def run_example(path: Path, argv: list[str], result: Path) -> None:
    """A node process: the example script at ``path`` run as its ``main(argv)``, the summary it
    returns written to ``result`` as JSON."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result.write_text(json.dumps(module.main(argv)))


@contextmanager
def connected(
    sender_options: dict[str, Any], receiver_options: dict[str, Any]
) -> Iterator[tuple[Transport, Transport]]:
    """A sender and a receiver ("a" and "b" on 127.0.0.1), once a message has gone between them."""
    sender_address, receiver_address = addresses(2)
    receiver = Transport("b", receiver_address, inbox_kinds={"params", "note"}, **receiver_options)
    sender = Transport("a", sender_address, **sender_options)
    receiver.start()
    sender.start()
    try:
        deadline = time.monotonic() + HANG_S
        while receiver.recv(0.05) is None:  # until the connection is up
            assert time.monotonic() < deadline, "no message from a reached b"
            sender.send(receiver_address, "note", 0)
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()

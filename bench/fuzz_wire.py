"""A live node fuzzed for minutes (the test suite runs seconds of the same, tests/test_fuzz_live.py).

The structure-aware fuzzer of ``tests/fuzz_live.py`` (hypothesis strategies from the wire schema,
mutations of valid messages of every kind, streams and beacons) sends to a node running in a
process of its own, as the daemon runs it, until the time is up, and with each batch an
insider's moves (``fuzz_live.insider_moves``: phantom member records, big messages of kinds
nobody reads, CHOCO updates for rounds ahead, lying state manifests, forged agreements). Between
batches:

- a stranger opens ``FLOOD`` TCP connections to the node from ``FLOOD_SOURCES`` addresses, each
  left in its handshake, and drops them (the caps of ``p2p.transport.inbound``);
- ``SLOW_CLIENTS`` HTTP clients trickle a byte each into the node's status endpoint while a
  probe asks ``/healthz`` (``gossipmesh.daemon.status_server``): the probe must be answered.

Beside the node, in its process, a D-PSGD pair averages in a mesh of its own with an insider
(a real member whose id the fuzzer takes) that sends the pair the same moves: each check starts
the pair 1.0 apart and runs ``PAIR_ROUNDS`` rounds; the spread must fall (the mesh converges).

Every 30 s and at the end it prints what was sent, how the node took it, its deaths (its network
thread stopping or a reader raising: must stay 0), what the insider pushed past a bound
(``fuzz_live.out_of_bounds``: must stay empty), the probes and the pair, and the node's resident
memory (must stay bounded).

    python bench/fuzz_wire.py --seconds 600
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fuzz_live import SIZE, Fuzzer, FuzzTarget, fuzz, insider_moves, out_of_bounds, settle
from helpers import addresses, average_in_threads
from hostile import free_udp_port, half_open, resident_bytes

from gossip import Algorithm
from gossip.algorithms.averager import RoundStats
from gossipmesh.daemon.metrics import NodeMetrics
from gossipmesh.daemon.peers import message_kinds
from gossipmesh.daemon.status_server import MAX_CONNECTIONS, StatusServer
from p2p import Peer

BATCH = 500  # examples per hypothesis run
INSIDER_BATCH = 100  # insider moves per batch, to the node and to the pair
REPORT_EVERY_S = 30.0
FLOOD = 1200  # connections a stranger leaves in their handshake between two batches
FLOOD_SOURCES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
SLOW_CLIENTS = MAX_CONNECTIONS + 16  # HTTP clients trickling a byte each while a probe asks
PAIR_ROUNDS = 20
PAIR_TIMEOUT_S = 0.5  # a round's wait for the silent insider


class Pair:
    """Two honest nodes averaging by D-PSGD on a ring with an insider (an idle member), on a
    thread of their own, over and over: each check's rounds that mixed something and the
    spread before and after."""

    def __init__(self) -> None:
        listen = addresses(3)
        kinds = message_kinds(Algorithm.parse("dpsgd"))
        self.peers = [
            Peer(f"pair-{i}", address, listen[:1] if i else [], inbox_kinds=kinds)
            for i, address in enumerate(listen[:2])
        ]
        self.insider = Peer("insider", listen[2], listen[:1], inbox_kinds=kinds)
        self.checks: list[dict[str, float]] = []
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pair", daemon=True)

    @property
    def members(self) -> dict[str, str]:
        return {peer.node_id: peer.address for peer in (*self.peers, self.insider)}

    def start(self) -> None:
        for peer in (*self.peers, self.insider):
            peer.start()
        for peer in (*self.peers, self.insider):
            peer.wait_ready(20, expect=3)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)
        for peer in (*self.peers, self.insider):
            peer.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            vectors = [np.zeros(SIZE, np.float32), np.ones(SIZE, np.float32)]
            stats: list[list[RoundStats]] = [[], []]
            try:
                average_in_threads(
                    self.peers,
                    vectors,
                    topology="ring",
                    rounds=PAIR_ROUNDS,
                    timeout=PAIR_TIMEOUT_S,
                    stats=stats,
                )
            except Exception as exc:  # an averaging that raises is a death of the pair
                self.error = f"{type(exc).__name__}: {exc}"
                return
            mixed = min(sum(s.arrived > 0 for s in node) for node in stats)
            spread = float(np.abs(vectors[0] - vectors[1]).max())
            self.checks.append({"mixed": mixed, "spread": spread})


def serve_target(beacon_port: int, control: Connection) -> None:
    """The node under fuzz, its status endpoint and the pair, in their own process: answers
    ``stats`` until ``stop``."""
    target = FuzzTarget(beacon_port)
    target.start()
    pair = Pair()
    pair.start()
    metrics = NodeMetrics(stale_after_s=math.inf)  # (no training loop: health is the network thread's)
    metrics.peer = target.target
    status = StatusServer(metrics, 0)
    control.send({"target": target.members, "pair": pair.members, "status_port": status.port})
    while (command := control.recv()) != "stop":
        if command == "settle":
            settle(target)
        stats = target.target.stats
        inbound = target.target.transport.inbound
        control.send(
            {
                "deaths": target.deaths + bool(pair.error),
                "rss_mib": resident_bytes() / 2**20,
                "received": stats.messages_received,
                "rejected": stats.messages_rejected,
                "read_by_algorithms": target.taken,
                "first_error": (target.errors[0] if target.errors else target.target.transport.failure)
                or pair.error,
                "reasons": dict(stats.rejected.most_common(6)),
                "connections_refused": dict(inbound.refused) if inbound else {},
                "out_of_bounds": out_of_bounds(target),
                "pair": list(pair.checks),
                "status_expired": status.expired,
                "status_evicted": status.evicted,
            }
        )
    status.close()
    pair.close()
    target.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    port = free_udp_port()
    control, remote = multiprocessing.get_context("spawn").Pipe()
    node = multiprocessing.get_context("spawn").Process(target=serve_target, args=(port, remote))
    node.start()
    mesh = control.recv()
    address = mesh["target"]["target"]
    fuzzer = Fuzzer(address, port)
    pair_fuzzers = [Fuzzer(mesh["pair"][p], port, insider="insider") for p in ("pair-0", "pair-1")]
    started = time.monotonic()
    first = _stats(control)
    print(f"node up: {first['rss_mib']:.1f} MiB resident", flush=True)

    next_report = started + REPORT_EVERY_S
    peak, probes, failed = first["rss_mib"], 0, 0
    while (now := time.monotonic()) < started + args.seconds:
        fuzz(fuzzer, BATCH)
        fuzz(fuzzer, INSIDER_BATCH, insider_moves(mesh["target"]))
        for pair_fuzzer in pair_fuzzers:
            fuzz(pair_fuzzer, INSIDER_BATCH // 2, insider_moves(mesh["pair"], "insider"))
        flood(address)
        with slow_clients(mesh["status_port"]):
            failure = healthz(mesh["status_port"])
        probes, failed = probes + 1, failed + bool(failure)
        if failure:
            print(f"/healthz probe {probes} failed: {failure}", flush=True)
        if now >= next_report:
            stats = _stats(control)
            peak = max(peak, stats["rss_mib"])
            _print(now - started, fuzzer.sent, stats, probes, failed)
            next_report += REPORT_EVERY_S
    stats = _stats(control, "settle")
    peak = max(peak, stats["rss_mib"])
    _print(time.monotonic() - started, fuzzer.sent, stats, probes, failed)
    converged = [check for check in stats["pair"] if check["spread"] < 0.5]
    print(
        f"done: {args.seconds:g} s, {fuzzer.sent:,} inputs to the node, "
        f"{sum(f.sent for f in pair_fuzzers):,} to the pair, {stats['deaths']} deaths, "
        f"out of bounds: {stats['out_of_bounds'] or 'nothing'}, /healthz {probes - failed}/{probes} "
        f"answered, pair converged in {len(converged)}/{len(stats['pair'])} checks, resident "
        f"{first['rss_mib']:.1f} MiB at start, {stats['rss_mib']:.1f} MiB at the end, {peak:.1f} MiB peak"
    )
    if stats["first_error"]:
        print(f"first death:\n{stats['first_error']}", file=sys.stderr)
    control.send("stop")
    node.join(60)
    for closable in (fuzzer, *pair_fuzzers):
        closable.close()
    bad = stats["deaths"] or stats["out_of_bounds"] or failed or len(converged) < len(stats["pair"])
    return 1 if bad or not stats["pair"] else 0


def flood(address: str) -> None:
    """``FLOOD`` connections to ``address`` from ``FLOOD_SOURCES``, left in their handshake (the
    node is insecure: its handshake waits for a greeting that never comes), then dropped."""
    sources = [FLOOD_SOURCES[i % len(FLOOD_SOURCES)] for i in range(FLOOD)]
    with half_open(address, sources, greeting=b"") as opened:
        if opened < FLOOD:
            print(f"flood stopped at {opened} connections (this process's descriptors)", flush=True)


@contextlib.contextmanager
def slow_clients(port: int) -> Iterator[None]:
    """``SLOW_CLIENTS`` connections to the status endpoint, each sending one byte of a request."""
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(SLOW_CLIENTS)]
    try:
        for client in clients:
            with contextlib.suppress(OSError):  # (evicted already)
                client.send(b"G")
        yield
    finally:
        for client in clients:
            client.close()


def healthz(port: int) -> str:
    """ "" when ``GET /healthz`` is answered 200 within 5 s, else what went wrong."""
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return "" if answer.status == 200 else f"status {answer.status}"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc} after {time.monotonic() - started:.1f} s"


def _stats(control: Connection, command: str = "stats") -> dict[str, Any]:
    control.send(command)
    stats: dict[str, Any] = control.recv()
    return stats


def _print(elapsed: float, sent: int, stats: dict[str, Any], probes: int, failed: int) -> None:
    pair = stats["pair"][-1] if stats["pair"] else None
    pair_text = (
        f"pair: {len(stats['pair'])} checks, last mixed in {pair['mixed']}/{PAIR_ROUNDS} rounds, "
        f"spread 1.0 -> {pair['spread']:.2g}"
        if pair
        else "pair: no check done yet"
    )
    print(
        f"[{elapsed:6.0f} s] sent {sent:,}; node: {stats['received']:,} taken in, "
        f"{stats['rejected']:,} rejected ({stats['reasons']}), "
        f"{stats['read_by_algorithms']:,} read by algorithms, "
        f"connections refused {stats['connections_refused']}, /healthz {probes - failed}/{probes} "
        f"({stats['status_evicted']:,} slow clients evicted, {stats['status_expired']:,} expired), "
        f"{pair_text}, out of bounds {stats['out_of_bounds'] or 0}, "
        f"deaths {stats['deaths']}, resident {stats['rss_mib']:.1f} MiB",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())

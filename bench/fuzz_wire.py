"""A live node fuzzed for minutes (the test suite runs seconds of the same, tests/test_fuzz_live.py).

The structure-aware fuzzer of ``tests/fuzz_live.py`` (hypothesis strategies from the wire schema,
mutations of valid messages of every kind, streams and beacons) sends to a node running in a
process of its own, as the daemon runs it, until the time is up; between batches a stranger
opens ``FLOOD`` idle TCP connections to the node from ``FLOOD_SOURCES`` addresses and drops
them (the inbound connection caps, ``p2p.transport.inbound``). Every 30 s and at the end it
prints what was sent, how the node took it, the node's deaths (its network thread stopping or a
reader raising: must stay 0) and its resident memory (must stay bounded).

    python bench/fuzz_wire.py --seconds 600
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fuzz_live import Fuzzer, FuzzTarget, fuzz, settle
from hostile import free_udp_port, resident_bytes

BATCH = 500  # examples per hypothesis run
REPORT_EVERY_S = 30.0
FLOOD = 1200  # idle TCP connections a stranger opens between two batches
FLOOD_SOURCES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def serve_target(beacon_port: int, control: Connection) -> None:
    """The node under fuzz, in its own process: answers ``stats`` until ``stop``."""
    target = FuzzTarget(beacon_port)
    target.start()
    control.send(target.target.address)
    while (command := control.recv()) != "stop":
        if command == "settle":
            settle(target)
        stats = target.target.stats
        inbound = target.target.transport.inbound
        control.send(
            {
                "deaths": target.deaths,
                "rss_mib": resident_bytes() / 2**20,
                "received": stats.messages_received,
                "rejected": stats.messages_rejected,
                "read_by_algorithms": target.taken,
                "first_error": target.errors[0] if target.errors else target.target.transport.failure,
                "reasons": dict(stats.rejected.most_common(6)),
                "connections_refused": inbound.refused.total() if inbound else 0,
            }
        )
    target.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    port = free_udp_port()
    control, remote = multiprocessing.get_context("spawn").Pipe()
    node = multiprocessing.get_context("spawn").Process(target=serve_target, args=(port, remote))
    node.start()
    address = control.recv()
    fuzzer = Fuzzer(address, port)
    started = time.monotonic()
    first = _stats(control)
    print(f"node up: {first['rss_mib']:.1f} MiB resident", flush=True)

    next_report = started + REPORT_EVERY_S
    peak = first["rss_mib"]
    while (now := time.monotonic()) < started + args.seconds:
        fuzz(fuzzer, BATCH)
        flood(address)
        if now >= next_report:
            stats = _stats(control)
            peak = max(peak, stats["rss_mib"])
            _print(now - started, fuzzer.sent, stats)
            next_report += REPORT_EVERY_S
    stats = _stats(control, "settle")
    peak = max(peak, stats["rss_mib"])
    _print(time.monotonic() - started, fuzzer.sent, stats)
    print(
        f"done: {args.seconds:g} s, {fuzzer.sent:,} inputs, {stats['deaths']} deaths, resident "
        f"{first['rss_mib']:.1f} MiB at start, {stats['rss_mib']:.1f} MiB at the end, {peak:.1f} MiB peak"
    )
    if stats["first_error"]:
        print(f"first death:\n{stats['first_error']}", file=sys.stderr)
    control.send("stop")
    node.join(30)
    fuzzer.close()
    return 1 if stats["deaths"] else 0


def flood(address: str) -> None:
    """``FLOOD`` idle TCP connections to ``address`` from ``FLOOD_SOURCES``, then dropped."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    connections = []
    try:
        for i in range(FLOOD):
            connection = socket.socket()
            connections.append(connection)
            connection.bind((FLOOD_SOURCES[i % len(FLOOD_SOURCES)], 0))
            connection.connect((host, int(port)))
    except OSError as exc:  # (this process's own descriptors: the flood stops there)
        print(f"flood stopped at {len(connections)} connections: {exc}", flush=True)
    finally:
        for connection in connections:
            connection.close()


def _stats(control: Connection, command: str = "stats") -> dict[str, Any]:
    control.send(command)
    stats: dict[str, Any] = control.recv()
    return stats


def _print(elapsed: float, sent: int, stats: dict[str, Any]) -> None:
    print(
        f"[{elapsed:6.0f} s] sent {sent:,}; node: {stats['received']:,} taken in, "
        f"{stats['rejected']:,} rejected ({stats['reasons']}), "
        f"{stats['read_by_algorithms']:,} read by algorithms, "
        f"{stats['connections_refused']:,} connections refused, "
        f"deaths {stats['deaths']}, resident {stats['rss_mib']:.1f} MiB",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())

"""A joiner takes a large training state (a wide MLP's parameters and AdamW's moments and step
counts: ~1.2 GB at 100M parameters) from one or several live members.

Every process is a real node (``gossipmesh.connect``, ZeroMQ, --insecure) with the same model and
a ``GossipOptimizer`` around AdamW after one step; the donors answer state requests from their
live state (``serve_state``, as a training loop's ``step()`` does), the joiner calls
``join_from`` with every donor. Printed per arm: the transfer's seconds and rate (against the
link's, with ``--link``), chunks asked again after a stall (restarts are not possible: chunks are
kept), chunks each donor gave, and the peak memory a donor added while serving and the joiner
added while receiving, against the state's bytes.

``--link MBPS`` puts each process in a network-namespace host of its own (root, iproute2) and
limits the joiner's downlink to MBPS with ``tc tbf``; without it, 127.0.0.1.

    python bench/state_transfer.py [--params 100M] [--donors 1,3] [--link 1000]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import threading
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import torch
from forked import run_forked
from scale import parse_count, reset_peak, rss, wide_mlp

import gossipmesh
from gossipmesh.config import NodeConfig, load
from gossipmesh.mesh import netns
from p2p.address import free_ports

PORT = 7000


def _node(rank: int, donors: int, params: int, endpoints: list[str], host: netns.Host | None,
          barrier: Barrier, out: Connection) -> None:  # fmt: skip
    """Rank 0 .. donors-1 serve; rank ``donors`` joins."""
    if host is not None:
        netns.enter(host)
    logging.disable(logging.WARNING)
    torch.manual_seed(0)
    model = wide_mlp(params)
    flags = {"insecure": True, "listen": endpoints[rank], "expect": str(donors + 1), "id": f"node-{rank}",
             **({"bootstrap": [endpoints[0]]} if rank else {})}  # fmt: skip
    config = load(NodeConfig, flags)
    peer = gossipmesh.connect(config, model)
    optimizer = config.gossip_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), peer)
    joiner = rank == donors
    if not joiner:
        for param in model.parameters():
            param.grad = torch.full_like(param, 1e-3)
        optimizer.optimizer.step()  # AdamW's moments and step counts exist
        optimizer.step_count = 100
    barrier.wait()
    base = reset_peak()
    if joiner:
        optimizer.join_from([f"node-{i}" for i in range(donors)], timeout=900)
        transfer = optimizer.last_transfer
        assert transfer is not None
        result: dict[str, Any] = {"transfer": transfer.summary(), "added_bytes": rss("VmHWM:") - base}
    else:
        done = threading.Event()
        threading.Thread(target=lambda: (barrier.wait(), done.set()), daemon=True).start()
        while not done.is_set():
            optimizer.serve_state(0.1)
        result = {"added_bytes": rss("VmHWM:") - base}
    if joiner:
        barrier.wait()
    optimizer.close()
    peer.close()
    out.send(result)


def run_arm(params: int, donors: int, link_mbps: float | None) -> dict[str, Any]:
    count = donors + 1
    barrier = multiprocessing.get_context("fork").Barrier(count)

    def launch(endpoints: list[str], hosts: list[netns.Host | None]) -> list[dict[str, Any]]:
        return run_forked(count, _node, lambda r: (r, donors, params, endpoints, hosts[r], barrier))

    if link_mbps is None:
        results = launch([f"tcp://127.0.0.1:{p}" for p in free_ports(count)], [None] * count)
    else:
        with netns.lan(count) as hosts:
            netns.cap_bandwidth(hosts[donors], f"{link_mbps}mbit", downlink=True)
            results = launch([f"tcp://{h.address}:{PORT}" for h in hosts], list(hosts))
    joiner, served = results[donors], results[:donors]
    return {
        "params": params,
        "donors": donors,
        "link_mbps": link_mbps,
        **joiner["transfer"],
        "joiner_added_bytes": joiner["added_bytes"],
        "donor_added_bytes_max": max(r["added_bytes"] for r in served),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", default="100M", help="model sizes (default: 100M)")
    parser.add_argument("--donors", default="1,3", help="donor counts, one arm each (default: 1,3)")
    parser.add_argument("--link", type=float, help="limit the joiner's downlink to MBPS (namespace hosts)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args()
    if args.link is not None and (why := netns.unavailable()):
        parser.error(f"--link: {why}")
    print(f"{'params':>7} {'state MB':>9} {'donors':>6} {'link':>6} {'seconds':>8} {'MB/s':>7} "
          f"{'of link':>8} {'reasked':>8} {'donor +MB':>10} {'joiner +MB':>11}  chunks per donor",
          flush=True)  # fmt: skip
    rows = []
    for params in map(parse_count, args.params.split(",")):
        for donors in map(int, args.donors.split(",")):
            row = run_arm(params, donors, args.link)
            rows.append(row)
            link = f"{args.link:g}" if args.link else "lo"
            share = f"{row['mb_per_s'] * 8 / args.link:.0%}" if args.link else "-"
            print(
                f"{params / 1e6:>6.0f}M {row['bytes'] / 1e6:>9.0f} {donors:>6} {link:>6} "
                f"{row['seconds']:>8.2f} {row['mb_per_s']:>7.0f} {share:>8} {row['reasked']:>8} "
                f"{row['donor_added_bytes_max'] / 1e6:>10.0f} {row['joiner_added_bytes'] / 1e6:>11.0f}  "
                f"{row['chunks']}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""The run report: one JSON schema for a single node and for a whole mesh.

``{"wall_time_s", "config", "nodes": [NodeRecord...], "consensus_distance"}``; tools and
benchmarks read it, so fields are only ever added. A node's record is made in one place,
:func:`node_record`, from what its training loop, its optimizer and its transport counted.
Files are written atomically.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

if TYPE_CHECKING:  # (the command line reads reports and logs through here: no torch, no sockets)
    from gossip import GossipStatistics
    from p2p import TransportStats

STATUSES = ("finished", "killed", "failed")


@dataclass
class TimelinePoint:
    t: float  # seconds since the mesh (or lone node) started
    step: int
    loss: float  # held-out loss of the node's current model
    accuracy: float  # held-out accuracy of the node's current model
    train_loss: float  # moving average of the minibatch loss
    bytes_sent: int
    round: int
    consensus: float | None = None  # the node's consensus distance estimate (see GossipOptimizer)
    batches: int = 0  # batches drawn, its own steps (``step`` counts those of skipped rounds too)


@dataclass
class NodeRecord:
    id: str
    rank: int
    address: str
    status: str = "failed"
    device: str = "cpu"  # where the model trained (--device)
    t_first_step: float | None = None
    t_joined: float | None = None  # set when the node joined a running mesh (mesh clock)
    t_killed: float | None = None  # set when the mesh killed it
    steps: int = 0
    rounds: int = 0
    topology_fallback_rounds: int = 0  # rounds averaged on the fallback graph (see topologies)
    staleness: dict[str, float] = field(default_factory=dict)  # of the messages mixed in
    final: dict[str, float] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    rejected_by_peer: dict[str, dict[str, int]] = field(default_factory=dict)  # peer -> reason -> count
    shunned_peers: list[str] = field(default_factory=list)
    resumed_from: str | None = None  # the checkpoint a restarted node resumed from
    checkpoint_failures: int = 0  # checkpoints that could not be written (each retried later)
    live_params_failures: int = 0  # --live-params copies that could not be written (retried later)
    # a node that joined a running mesh: bytes, seconds, mb_per_s, chunks per source, reasked,
    # dropped_sources and outvoted (source -> why)
    state_transfer: dict[str, Any] = field(default_factory=dict)
    timeline: list[TimelinePoint] = field(default_factory=list)
    error: str | None = None
    shard: dict[str, Any] = field(default_factory=dict)  # partition, examples, examples per label
    phase_seconds: dict[str, float] = field(default_factory=dict)  # totals per phase (gossip.phases)
    # with --local-steps/--average-every auto: [first round of an epoch, the H the mesh agreed]
    local_steps_per_epoch: list[list[int]] = field(default_factory=list)
    codec_per_epoch: list[list[int | str]] = field(default_factory=list)
    # a machine of several local ranks (--local-ranks): one entry per rank (local_rank, address,
    # steps, bytes_sent and bytes_received on the network, bytes_local through the machine's
    # collectives, params_digest of its final parameters (with --shard: of its shard), and what
    # it holds: parameters, parameter_bytes, optimizer_state_bytes); the machine's bytes_sent /
    # bytes_received are then the ranks' sums
    local_ranks: list[dict[str, Any]] = field(default_factory=list)
    bytes_local: int = 0  # the ranks' bytes_local summed


@dataclass
class Progress:
    """What a node's training loop recorded: the trainer keeps it as it goes; a mesh rebuilds it
    from the progress lines of a node that left no report."""

    steps: int = 0
    t_first_step: float | None = None
    timeline: list[TimelinePoint] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)  # held-out loss and accuracy at the end
    shard: dict[str, Any] = field(default_factory=dict)
    checkpoint_failures: int = 0  # checkpoints that could not be written (and were tried again)
    live_params_failures: int = 0  # --live-params copies that could not be written (tried again)
    state_transfer: dict[str, Any] = field(default_factory=dict)  # how a joiner's state arrived


def node_record(
    *,
    id: str,
    rank: int,
    address: str,
    status: str,
    progress: Progress,
    device: str = "cpu",
    gossip: GossipStatistics | None = None,
    network: TransportStats | None = None,
    **when: Any,
) -> NodeRecord:
    """A node's record. Without the optimizer's statistics or the transport's counters (a node
    killed before it wrote its own) rounds and bytes sent are those of its last timeline point.
    ``when``: ``t_joined``, ``t_killed``, ``resumed_from``, ``error``."""
    last = progress.timeline[-1] if progress.timeline else None
    record = NodeRecord(
        id=id,
        rank=rank,
        address=address,
        status=status,
        device=device,
        t_first_step=progress.t_first_step,
        steps=progress.steps,
        rounds=gossip.round if gossip else last.round if last else 0,
        final=progress.final,
        timeline=progress.timeline,
        shard=progress.shard,
        checkpoint_failures=progress.checkpoint_failures,
        live_params_failures=progress.live_params_failures,
        state_transfer=progress.state_transfer,
        bytes_sent=network.bytes_sent if network else last.bytes_sent if last else 0,
        **when,
    )
    if gossip is not None:
        record.topology_fallback_rounds = gossip.fallback_rounds
        record.staleness = gossip.staleness
        record.phase_seconds = gossip.phase_seconds
        record.local_steps_per_epoch = [list(decision) for decision in gossip.local_steps_per_epoch]
        record.codec_per_epoch = [list(decision) for decision in gossip.codec_per_epoch]
    rejected = Counter(gossip.rejected if gossip else {})
    dropped = Counter(gossip.dropped if gossip else {})
    if network is not None:
        record.bytes_received = network.bytes_received
        rejected += network.rejected
        dropped += network.dropped
        record.rejected_by_peer = {peer: dict(reasons) for peer, reasons in network.rejected_by_peer.items()}
        record.shunned_peers = sorted(network.rejections.shunned_peers)
    record.rejected_by_reason = dict(rejected)
    record.messages_rejected = sum(rejected.values())
    record.dropped_by_reason = dict(dropped)
    if record.local_ranks:
        for total in ("bytes_sent", "bytes_received", "bytes_local"):
            setattr(record, total, sum(int(r[total]) for r in record.local_ranks))
    return record


def build_report(
    *,
    wall_time_s: float,
    config: dict[str, Any],
    nodes: list[dict[str, Any]],
    consensus_distance: float | None,
    membership_events: list[dict[str, Any]],
) -> dict[str, Any]:
    """The report; ``membership_events`` are ``{"t", "observer", "node", "event"}``, by time."""
    return {
        "wall_time_s": wall_time_s,
        "config": config,
        "nodes": nodes,
        "consensus_distance": consensus_distance,
        "membership_events": sorted(membership_events, key=lambda e: (e["t"], e["observer"])),
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` so that ``path`` is always either the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as stream:
            json.dump(json_safe(payload), stream, indent=1, allow_nan=False)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_array(path: Path, array: np.ndarray, *, sync: bool = True) -> None:
    """Write ``array`` (.npy) so that ``path`` is always either the old file or the whole new
    one; ``sync``: on disk before it replaces the old one (a final model), not only in the page
    cache (a live copy rewritten every second)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open_private(tmp) as stream:
        np.save(stream, array, allow_pickle=False)
        if sync:
            stream.flush()
            os.fsync(stream.fileno())
    os.replace(tmp, path)


def open_private(path: Path) -> BinaryIO:
    """``path`` (created, or emptied) for writing, readable by its owner only (0600): model
    parameters and checkpoints are what the mesh trains, not for every local user to copy."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # (a file left there before keeps its mode through O_CREAT)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities (a diverged loss) as null: strict JSON rejects them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def read_json(path: Path) -> dict[str, Any]:
    with path.open() as stream:
        report: dict[str, Any] = json.load(stream)
    return report

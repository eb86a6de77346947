"""A node's Prometheus metrics, with the liveness and readiness they are served beside.

Most figures are read at scrape time from the objects that keep them (the transport's
counters, the membership view, the optimizer's statistics), so the training loop pays nothing
for them; only
the per-round histograms are observed as rounds end. Names carry one ``gossipmesh_`` prefix and
base units (seconds, bytes, ratios).
"""

from __future__ import annotations

import platform
import threading
import time
from collections import Counter
from collections.abc import Iterator
from importlib import metadata
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gossip.phases import PHASES

if TYPE_CHECKING:  # (StatusServerError, which the command line catches, comes from this room)
    from gossip import GossipOptimizer
    from p2p import Peer

ROUND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Training(Protocol):
    """What the metrics read of a node's training (``gossipmesh.daemon.trainer.Trainer``)."""

    optimizer: GossipOptimizer
    train_loss: float

    @property
    def steps(self) -> int: ...

    @property
    def evaluation(self) -> tuple[float, float] | None:
        """Held-out (loss, accuracy) at the last timeline point."""
        ...


class NodeMetrics:
    """The registry of one node, and its health: ``alive()`` is the daemon's own loop having
    made progress within ``stale_after_s`` (never tied to peers, so a network partition does
    not restart the node); ``ready()`` is having joined a mesh and not left it."""

    def __init__(self, *, stale_after_s: float) -> None:
        self.registry = CollectorRegistry()
        self.round_duration = Histogram(
            "gossipmesh_round_duration_seconds",
            "Gossip round time on the training thread (send, wait, mix; not compute)",
            buckets=ROUND_BUCKETS,
            registry=self.registry,
        )
        self.phase_duration = Histogram(
            "gossipmesh_round_phase_seconds",
            "Time per round in each phase: compute, encode, send, wait, decode, mix",
            ["phase"],
            buckets=ROUND_BUCKETS,
            registry=self.registry,
        )
        self.peer: Peer | None = None
        self.training: Training | None = None
        self._stale_after_s = stale_after_s
        self._last_beat = time.monotonic()
        self._left = threading.Event()
        self.registry.register(_Collector(self))

    def beat(self) -> None:
        """The daemon's loop is making progress."""
        self._last_beat = time.monotonic()

    def alive(self) -> bool:
        return time.monotonic() - self._last_beat < self._stale_after_s

    def ready(self) -> bool:
        return self.peer is not None and self.peer.membership.joined.is_set() and not self._left.is_set()

    def leaving(self) -> None:
        self._left.set()

    def observe_round(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.phase_duration.labels(phase).observe(seconds)
        self.round_duration.observe(sum(v for k, v in phases.items() if k != "compute"))


class _Collector(Collector):
    def __init__(self, metrics: NodeMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield _build_info()
        peer, training = self._metrics.peer, self._metrics.training
        if peer is not None:
            yield from _network(peer, training)
        if training is not None:
            yield from _training(training)


def _build_info() -> Metric:
    info = GaugeMetricFamily(
        "gossipmesh_build_info", "Versions this node runs", labels=["version", "python", "torch"]
    )
    info.add_metric([metadata.version("gossipmesh"), platform.python_version(), metadata.version("torch")], 1)
    return info


def _network(peer: Peer, training: Training | None) -> Iterator[Metric]:
    stats = peer.stats
    yield _counter("sent_bytes", "Bytes sent to peers (at the socket)", stats.bytes_sent)
    yield _counter("received_bytes", "Bytes received from peers (at the socket)", stats.bytes_received)
    peers = GaugeMetricFamily("gossipmesh_peers", "Other members known, by state", labels=["state"])
    for state, count in peer.membership.peer_states().items():
        peers.add_metric([state], count)
    yield peers
    gossip = training.optimizer.statistics() if training is not None else None
    rejected = stats.rejected + Counter(gossip.rejected if gossip else {})
    dropped = stats.dropped + Counter(gossip.dropped if gossip else {})
    yield _by_reason("messages_rejected", "Malformed messages dropped, by reason", rejected)
    yield _by_reason("messages_dropped", "Well-formed messages not used (stale, too early...)", dropped)


def _training(training: Training) -> Iterator[Metric]:
    gossip = training.optimizer.statistics()
    yield _counter("steps", "Local optimizer steps taken", training.steps)
    yield _counter("rounds", "Gossip rounds reached (model version for adpsgd)", gossip.round)
    yield _gauge("train_loss", "Moving average of the minibatch loss", training.train_loss)
    if training.evaluation is not None:
        loss, accuracy = training.evaluation
        yield _gauge("eval_loss", "Held-out loss of the current model", loss)
        yield _gauge("eval_accuracy_ratio", "Held-out accuracy of the current model", accuracy)
    yield _gauge("staleness_mean_rounds", "Mean age of the messages mixed in", gossip.staleness["mean"])
    yield _gauge("staleness_max_rounds", "Oldest message mixed in", gossip.staleness["max"])
    if gossip.consensus is not None:
        yield _gauge(
            "consensus_distance_ratio",
            "Estimated distance to the neighbours' models: ||x after mixing - x before|| / ||x||",
            gossip.consensus,
        )
    seconds = CounterMetricFamily(
        "gossipmesh_phase_seconds", "Time spent in each phase of the rounds so far", labels=["phase"]
    )
    for phase in PHASES:
        seconds.add_metric([phase], gossip.phase_seconds[phase])
    yield seconds


def _counter(name: str, documentation: str, value: float) -> Metric:
    return CounterMetricFamily(f"gossipmesh_{name}", documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> Metric:
    return GaugeMetricFamily(f"gossipmesh_{name}", documentation, value=value)


def _by_reason(name: str, documentation: str, counts: Counter[str]) -> Metric:
    family = CounterMetricFamily(f"gossipmesh_{name}", documentation, labels=["reason"])
    for reason, count in sorted(counts.items()):
        family.add_metric([reason], count)
    return family

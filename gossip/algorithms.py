"""Averaging algorithms by name: ``NAME`` or ``NAME:key=value,...``, as in ``--algorithm``.

==========  ========================================================  =========================
name        what it is                                                parameters (default)
==========  ========================================================  =========================
dpsgd       synchronous D-PSGD; a round waits (bounded) for the       backup (0: all),
            neighbours (overlap=1: for last round's, mixed late)       overlap (0), staleness (0)
sgp         Stochastic Gradient Push: push-sum on a directed,         overlap (1), staleness (256)
            time-varying graph
adpsgd      asynchronous pairwise averaging on a background thread;   interval_ms (5),
            training never waits                                      staleness (1000)
choco       CHOCO-SGD: sends compressed differences to public         gamma (by compression)
            replicas (``--compression``)
==========  ========================================================  =========================

Only ``choco`` compresses: the others send whole models, which a lossy codec would corrupt
without the replicas that carry CHOCO's error feedback.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from gossip.adpsgd import ADPSGD
from gossip.averager import Averager
from gossip.choco import CHOCO
from gossip.compression import Codec
from gossip.dpsgd import DPSGD
from gossip.network import PeerNetwork
from gossip.robust import RobustRule
from gossip.sgp import SGP
from topologies import Topology


@dataclass(frozen=True)
class _Family:
    build: Callable[..., Averager]
    params: dict[str, Callable[[str], Any]]  # name -> parser
    default_topology: str
    compresses: bool = False


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _bit(text: str) -> int:
    if text not in ("0", "1"):
        raise ValueError(text)
    return int(text)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(text)
    return value


FAMILIES: dict[str, _Family] = {
    "dpsgd": _Family(DPSGD, {"backup": _count, "overlap": _bit, "staleness": _count}, "ring"),
    "sgp": _Family(SGP, {"overlap": _count, "staleness": _count}, "one-peer-exponential"),
    "adpsgd": _Family(ADPSGD, {"interval_ms": _positive, "staleness": _count}, "ring"),
    "choco": _Family(CHOCO, {"gamma": _fraction}, "ring", compresses=True),
}
ALGORITHMS = tuple(FAMILIES)


class AlgorithmError(ValueError):
    """An algorithm name or parameter that is not known; the message lists what is."""


@dataclass(frozen=True)
class Algorithm:
    """An algorithm with its parameters, e.g. ``Algorithm.parse("dpsgd:backup=1")``."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, spec: str) -> Algorithm:
        name, _, rest = spec.strip().partition(":")
        if name not in FAMILIES:
            raise AlgorithmError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
        accepted = FAMILIES[name].params
        params = {}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            if key not in accepted:
                raise AlgorithmError(f"{name}: unknown parameter {key!r}; it takes: {', '.join(accepted)}")
            try:
                params[key] = accepted[key](value)
            except ValueError:
                raise AlgorithmError(f"{name}: {key}={value!r} is not a valid {key}") from None
        return cls(name, tuple(sorted(params.items())))

    def __str__(self) -> str:
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in self.params) if self.params else "")

    @property
    def default_topology(self) -> str:
        return FAMILIES[self.name].default_topology

    @property
    def compresses(self) -> bool:
        return FAMILIES[self.name].compresses

    def build(
        self,
        peer: PeerNetwork,
        params: np.ndarray,
        *,
        topology: Topology,
        round_timeout: float,
        lock: AbstractContextManager[object] | None,
        codec: Codec | None = None,
        robust: RobustRule | None = None,
    ) -> Averager:
        """The averager; ValueError when ``codec`` compresses and this algorithm cannot, or a
        robust rule is given to an algorithm other than dpsgd."""
        codec = codec or Codec()
        options: dict[str, Any] = dict(self.params)
        if self.compresses:
            options["codec"] = codec
        elif codec.name != "none":
            raise ValueError(
                f"--compression {codec} needs --algorithm choco: {self.name} sends whole models, "
                "and only CHOCO's replicas keep convergence under a lossy codec"
            )
        if robust is not None:
            if self.name != "dpsgd":
                raise AlgorithmError(f"robust mixing ({robust}) works with dpsgd only, not {self.name}")
            options["robust"] = robust
        if "staleness" in options:
            options["max_staleness"] = options.pop("staleness")
        if "interval_ms" in options:
            options["interval_s"] = options.pop("interval_ms") / 1000
        family = FAMILIES[self.name]
        return family.build(
            peer, params, topology=topology, round_timeout=round_timeout, lock=lock, **options
        )

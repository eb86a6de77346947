"""Averaging algorithms by name: ``NAME`` or ``NAME:key=value,...``, as in ``--algorithm``.

==========  ========================================================  =========================
name        what it is                                                parameters (default)
==========  ========================================================  =========================
dpsgd       synchronous D-PSGD; a round waits (bounded) for the       backup (0: all),
            neighbours (overlap=1: for last round's, mixed late);     overlap (0), staleness (0),
            every exact_every-th round averages all members           exact_every (0: never)
sgp         Stochastic Gradient Push: push-sum on a directed,         overlap (1), staleness (256)
            time-varying graph
adpsgd      asynchronous pairwise averaging on a background thread;   interval_ms (5),
            training never waits                                      staleness (1000)
choco       CHOCO-SGD: sends compressed differences to public         gamma (by compression)
            replicas (``--compression``)
==========  ========================================================  =========================

What each algorithm works with is declared on its class (``Averager.needs``) and checked here
once, by :meth:`Algorithm.check`, for the command line and the library alike: only ``choco``
compresses (the others send whole models, which a lossy codec would corrupt without the
replicas that carry CHOCO's error feedback), only ``dpsgd`` mixes robustly, and ``adpsgd`` and
``choco`` need a static undirected graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from gossip.algorithms.adpsgd import ADPSGD
from gossip.algorithms.averager import Averager, IncompatibleOptionsError
from gossip.algorithms.choco import CHOCO
from gossip.algorithms.dpsgd import DPSGD
from gossip.algorithms.robust import RobustRule
from gossip.algorithms.sgp import SGP
from gossip.buffers.vector import Layout
from gossip.compression import Codec
from gossip.network import PeerNetwork
from topologies import Params, Spec, Topology
from topologies.spec import number


@dataclass(frozen=True)
class _Family:
    averager: type[Averager]
    params: Params
    default_topology: Topology
    renamed: Mapping[str, str]  # spelling -> the averager's keyword (staleness -> max_staleness)
    mixes_late: bool = False  # by default (overlap unless overlap=0; a background exchanger)


_COUNT = number(int, at_least=0)
_STALENESS = {"staleness": _COUNT}
FAMILIES: dict[str, _Family] = {
    family.averager.name: family
    for family in (
        _Family(
            DPSGD,
            Params(
                {
                    "backup": _COUNT,
                    "overlap": number(int, at_least=0, at_most=1),
                    "exact_every": _COUNT,
                    "catch_up": _COUNT,
                    **_STALENESS,
                }
            ),
            Topology("ring"),
            {"staleness": "max_staleness"},
        ),
        _Family(
            SGP,
            Params({"overlap": _COUNT, **_STALENESS}),
            Topology("one-peer-exponential"),
            {"staleness": "max_staleness"},
            mixes_late=True,
        ),
        _Family(
            ADPSGD,
            Params({"interval_ms": number(float, above=0), **_STALENESS}),
            Topology("ring"),
            {"staleness": "max_staleness"},
            mixes_late=True,
        ),
        _Family(CHOCO, Params({"gamma": number(float, above=0, at_most=1)}), Topology("ring"), {}),
    )
}
ALGORITHMS = tuple(FAMILIES)
_CHOICES = {name: family.params for name, family in FAMILIES.items()}


@dataclass(frozen=True)
class Algorithm(Spec, what="algorithm", choices=_CHOICES):
    """An algorithm with its parameters, e.g. ``Algorithm.parse("dpsgd:backup=1")``."""

    @property
    def family(self) -> _Family:
        return FAMILIES[self.name]

    @property
    def default_topology(self) -> Topology:
        return self.family.default_topology

    @property
    def compresses(self) -> bool:
        return self.family.averager.needs.compression

    @property
    def mixes_late(self) -> bool:
        """Whether it mixes values a round late (``overlap``) or in the background, off the
        round the training loop runs, so a round's cost is hidden from it."""
        overlap = self.options.get("overlap")
        return self.family.mixes_late if overlap is None else overlap > 0

    def check(
        self,
        *,
        topology: Topology | None = None,
        codec: Codec | None = None,
        robust: RobustRule | None = None,
    ) -> None:
        """Raise :class:`IncompatibleOptionsError` unless this algorithm works with the topology
        (None: its default), the codec and the robust rule."""
        needs = self.family.averager.needs
        graph = topology or self.default_topology
        if codec is not None and codec.name != "none" and not needs.compression:
            raise IncompatibleOptionsError(
                f"--compression {codec} needs --algorithm {_having('compression')}: {self.name} sends "
                "whole models, and only CHOCO's replicas keep convergence under a lossy codec"
            )
        if robust is not None and not needs.robust_mixing:
            raise IncompatibleOptionsError(
                f"--robust {robust} works with --algorithm {_having('robust_mixing')}, not {self.name}"
            )
        needs.check_graph(self.name, graph)

    def build(
        self,
        peer: PeerNetwork,
        params: np.ndarray,
        *,
        topology: Topology | None = None,
        round_timeout: float,
        lock: AbstractContextManager[object] | None,
        codec: Codec | None = None,
        robust: RobustRule | None = None,
        layout: Layout | None = None,
    ) -> Averager:
        """The averager, after :meth:`check`; ``layout``: how the model's values go on the wire
        (see ``gossip.buffers.vector.Layout``)."""
        self.check(topology=topology, codec=codec, robust=robust)
        family = self.family
        options: dict[str, Any] = {family.renamed.get(k, k): v for k, v in self.params}
        if "interval_ms" in options:
            options["interval_s"] = options.pop("interval_ms") / 1000
        if family.averager.needs.compression:
            options["codec"] = codec or Codec()
        if robust is not None:
            options["robust"] = robust
        return family.averager(
            peer,
            params,
            topology=topology or self.default_topology,
            round_timeout=round_timeout,
            lock=lock,
            layout=layout,
            **options,
        )


def _having(need: str) -> str:
    """The algorithms whose class declares ``need``, as ``a or b``."""
    return " or ".join(name for name, family in FAMILIES.items() if getattr(family.averager.needs, need))

"""Averaging algorithms by name: ``NAME`` or ``NAME:key=value,...`` (``Algorithm.parse``).

Each algorithm is one :class:`AlgorithmFamily` in :data:`FAMILIES` (a new one: a module in this
room and one entry there): its averager class, the parameters it takes and its row of the docs'
table (:func:`algorithm_table`, which ``docs/algorithms.md`` holds). What each algorithm works
with is declared on its class (``Averager.needs``) and checked here once, by
:meth:`Algorithm.check`, for the command line and the library alike: only ``choco`` compresses
(the others send whole models, which a lossy codec would corrupt without the replicas that carry
CHOCO's error feedback), only ``dpsgd`` mixes robustly, and ``adpsgd`` and ``choco`` need a
static undirected graph; ``average_every="auto"``, an outer step and the momentum options have
their rules beside those.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gossip.algorithms.adpsgd import ADPSGD
from gossip.algorithms.averager import Averager, IncompatibleOptionsError
from gossip.algorithms.choco import CHOCO
from gossip.algorithms.dpsgd import DPSGD
from gossip.algorithms.pace import CATCH_UP, STRAGGLERS
from gossip.algorithms.robust import RobustRule
from gossip.algorithms.sgp import SGP
from gossip.buffers.vector import Layout
from gossip.compression import Codec
from gossip.network import PeerNetwork
from topologies import Params, Spec, Topology
from topologies.spec import choice, number


@dataclass(frozen=True)
class AlgorithmFamily:
    """One algorithm as the registry knows it; ``summary`` and ``parameters`` are its row of
    the docs' table (markdown)."""

    averager: type[Averager]
    params: Params
    default_topology: Topology
    summary: str
    parameters: str
    renamed: Mapping[str, str] = field(default_factory=dict)  # spelling -> the averager's keyword
    mixes_late: bool = False  # by default (overlap unless overlap=0; a background exchanger)


_COUNT = number(int, at_least=0)
_STALENESS = {"staleness": _COUNT}
_STRAGGLERS = choice(STRAGGLERS)


def _stragglers_doc(also: str = "") -> str:
    """The docs of ``stragglers=``; ``also``: what else ``tolerate`` does in that algorithm."""
    return (
        "`stragglers` (`tolerate`): do not wait for a neighbour whose values arrive consistently later "
        "than the others' (measured; mixed when in, or late within the age its lag predicts; the "
        f"report's `staleness.stragglers_passed_over`){also}; `wait`: wait for every neighbour, which "
        "keeps the mean exact and runs the mesh at its slowest node's pace"
    )


_CATCH_UP_DOC = (
    f"`catch_up` ({CATCH_UP} with `stragglers=tolerate` on a static graph, else 0 = never): a node "
    "that hears its neighbours that many rounds ahead skips to the round after theirs (a straggler "
    "otherwise falls ever further behind and mixes values long gone by; the report's "
    "`staleness.rounds_skipped`; its step count moves on with them, `staleness.steps_skipped`, "
    "so a `--steps` budget ends it with the mesh"
)
FAMILIES: dict[str, AlgorithmFamily] = {
    family.averager.name: family
    for family in (
        AlgorithmFamily(
            DPSGD,
            Params(
                {
                    "backup": _COUNT,
                    "overlap": number(int, at_least=0, at_most=1),
                    "exact_every": _COUNT,
                    "catch_up": _COUNT,
                    "stragglers": _STRAGGLERS,
                    **_STALENESS,
                }
            ),
            Topology("ring"),
            summary=(
                "synchronous D-PSGD (Lian et al. 2017): after each step a round sends the model to the "
                "round's neighbours, waits (bounded) for theirs and mixes"
            ),
            parameters=(
                _stragglers_doc(
                    ", and send a neighbour no value while two are still leaving for it (a link that "
                    "carries less than is sent: the report's `staleness.sends_held`)"
                )
                + "; "
                "`backup` (0 = all): proceed once that many neighbours' values are in (backup workers); "
                "`overlap` (0; 1: mix the previous round's values, see [local "
                "steps](compression.md#local-steps)); `staleness` (0); `exact_every` (0 = never): every "
                "that many rounds, a round on the complete graph of the round's members, after which the "
                "models equal their average when every value came (periodic global averaging, Chen et al. "
                "2021; n - 1 models sent that round); "
                f"{_CATCH_UP_DOC}; not with `overlap`); and a node more than that many rounds ahead of "
                "every neighbour whose last round mixed none of their values waits for them before "
                "its next round (`staleness.rounds_waited_ahead`)"
            ),
            renamed={"staleness": "max_staleness"},
        ),
        AlgorithmFamily(
            SGP,
            Params({"overlap": _COUNT, "stragglers": _STRAGGLERS, **_STALENESS}),
            Topology("one-peer-exponential"),
            summary=(
                "Stochastic Gradient Push (Assran et al. 2019): push-sum of (x, w) on a directed, "
                "time-varying graph (`one-peer-exponential` unless `--topology` says otherwise); the "
                "model is x / w"
            ),
            parameters=(
                "`overlap` (1): wait for the shares of `overlap` rounds ago, so communication hides "
                "behind the next step; `stragglers` (`tolerate`): do not wait for an in-neighbour whose "
                "shares arrive consistently later than the others' (push-sum mixes them whenever they "
                "come), and keep the share of an out-neighbour whose link still carries an earlier push "
                "rather than queue it (the report's `staleness.sends_held`); `wait`: wait for every one, "
                "as a synchronous mesh does; `staleness` (256)"
            ),
            renamed={"staleness": "max_staleness"},
            mixes_late=True,
        ),
        AlgorithmFamily(
            ADPSGD,
            Params({"interval_ms": number(float, above=0), **_STALENESS}),
            Topology("ring"),
            summary=(
                "AD-PSGD (Lian et al. 2018): a background exchanger atomically averages the model with "
                "one neighbour at a time; training never waits"
            ),
            parameters=("`interval_ms` (5): least time between exchanges a node starts; `staleness` (1000)"),
            renamed={"staleness": "max_staleness"},
            mixes_late=True,
        ),
        AlgorithmFamily(
            CHOCO,
            Params(
                {"gamma": number(float, above=0, at_most=1), "stragglers": _STRAGGLERS, "catch_up": _COUNT}
            ),
            Topology("ring"),
            summary=(
                "CHOCO-SGD (Koloskova et al. 2019): sends the compressed difference between the model and "
                "its public copy (`--compression`); static undirected graphs"
            ),
            parameters=(
                "`gamma`: consensus step size (1 for dense codecs; for `topk` and `randk` adapted each "
                "round to the share of the owed difference a message carries: [the consensus step "
                f"size](compression.md#the-consensus-step-size)); {_stragglers_doc()}; {_CATCH_UP_DOC})"
            ),
        ),
    )
}
ALGORITHMS = FAMILIES.keys()  # (a live view: a registered algorithm appears in it)
_CHOICES = {name: family.params for name, family in FAMILIES.items()}


def register(family: AlgorithmFamily) -> None:
    """Add an algorithm (a plugin's, or a test's): it parses, builds and shows wherever the
    built-in ones do (``--help``, the config checks, :func:`algorithm_table`)."""
    name = family.averager.name
    if name in FAMILIES:
        raise ValueError(f"an algorithm named {name!r} is registered already")
    FAMILIES[name] = family
    _CHOICES[name] = family.params


def algorithm_table() -> str:
    """The docs' table of algorithms (markdown), one row per registered algorithm."""
    rows = [f"| `{name}` | {family.summary} | {family.parameters} |" for name, family in FAMILIES.items()]
    return "\n".join(["| name | what it is | parameters (default) |", "|---|---|---|", *rows])


@dataclass(frozen=True)
class Algorithm(Spec, what="algorithm", choices=_CHOICES):
    """An algorithm with its parameters, e.g. ``Algorithm.parse("dpsgd:backup=1")``."""

    @property
    def family(self) -> AlgorithmFamily:
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

    def piece_kinds(self, robust: RobustRule | None = None, codec: Codec | None = None) -> tuple[str, ...]:
        """The kinds its averager, built with ``robust`` and ``codec``, takes piece by piece
        (see ``Averager.piece_kinds``)."""
        return self.family.averager.piece_kinds(self._build_options(robust, codec))

    def check(
        self,
        *,
        topology: Topology | None = None,
        codec: Codec | None = None,
        robust: RobustRule | None = None,
        average_every: int | str = 1,
        outer_step: bool = False,
        quasi_global_momentum: float = 0.0,
        mix_momentum: bool = False,
        local_ranks: bool = False,
    ) -> None:
        """Raise :class:`IncompatibleOptionsError` unless this algorithm works with these
        options of ``GossipOptimizer`` (the message names them as its arguments, ``name=``):
        the topology (None: its default), codec and robust rule, ``average_every="auto"`` (which
        measures rounds), an outer step (``outer_lr``), quasi-global momentum, mixed momentum
        and local ranks (``local_group``)."""
        needs = self.family.averager.needs
        graph = topology or self.default_topology
        if codec is not None and codec.name != "none" and not needs.compression:
            raise IncompatibleOptionsError(
                f"compression={codec} needs algorithm={_having('compression')}: {self.name} sends "
                "whole models, and only CHOCO's replicas keep convergence under a lossy codec"
            )
        if robust is not None and not needs.robust_mixing:
            raise IncompatibleOptionsError(
                f"robust={robust} works with algorithm={_having('robust_mixing')}, not {self.name}"
            )
        needs.check_graph(self.name, graph)
        if average_every == "auto" and self.mixes_late:
            raise IncompatibleOptionsError(
                f"average_every=auto measures what a round costs, which algorithm={self} hides "
                "(it mixes a round late or in the background); use dpsgd, choco or sgp:overlap=0"
            )
        if quasi_global_momentum and outer_step:
            raise IncompatibleOptionsError(
                "quasi_global_momentum= does not go with an outer step (outer_lr=): it has a "
                "momentum of its own (outer_momentum=)"
            )
        if mix_momentum and (outer_step or quasi_global_momentum or local_ranks):
            raise IncompatibleOptionsError(
                "mix_momentum= mixes the local optimizer's momentum: not with an outer step "
                "(outer_lr=) or quasi_global_momentum= (momentum steps of their own), nor with "
                "local_group= (each rank gossips a slice of the parameters alone)"
            )

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
        return self.family.averager(
            peer,
            params,
            topology=topology or self.default_topology,
            round_timeout=round_timeout,
            lock=lock,
            layout=layout,
            **self._build_options(robust, codec),
        )

    def _build_options(self, robust: RobustRule | None, codec: Codec | None) -> dict[str, Any]:
        """The averager's keyword arguments beyond the common ones."""
        options = self._averager_options()
        if self.family.averager.needs.compression:
            options["codec"] = codec or Codec()
        if robust is not None:
            options["robust"] = robust
        return options

    def _averager_options(self) -> dict[str, Any]:
        """The parameters as the averager's keyword arguments."""
        options: dict[str, Any] = {self.family.renamed.get(k, k): v for k, v in self.params}
        if "interval_ms" in options:
            options["interval_s"] = options.pop("interval_ms") / 1000
        return options


AUTO = "auto"  # an option the mesh chooses: the algorithm here, average_every in the optimizer
# ``auto``'s order of preference, from docs/algorithms.md#which-algorithm (8 nodes, one 4x
# slower): AD-PSGD never waits and was the fastest arm that averages after every step; SGP
# next, for the graphs AD-PSGD does not take (directed, time-varying); D-PSGD for robust mixing;
# CHOCO, the one that compresses. With an outer step or periodic averaging the rounds are
# D-PSGD's, passing over measured stragglers (AD-PSGD's background exchanges do not come every H
# steps, and a round that waits for a straggler every H steps runs at its pace).
PREFERENCE = ("adpsgd", "sgp", "dpsgd", "choco")
LOCAL_STEPS_ALGORITHM = "dpsgd:stragglers=tolerate"
PERIODIC_PREFERENCE = (LOCAL_STEPS_ALGORITHM, "choco:stragglers=tolerate", "sgp", "adpsgd")
#: ``auto``'s local steps (an outer step every H) where no other option asks for something
#: else: the fastest arm to 0.95 on every node, with even nodes and with one 4x slower, and a
#: tenth of the bytes (docs/algorithms.md#which-algorithm)
AUTO_LOCAL_STEPS = 10


def choose_algorithm(**options: Any) -> Algorithm:
    """``auto``: the first algorithm of the preference above (each with its defaults) that
    works with ``options`` (:meth:`Algorithm.check`'s); registered ones come last.
    Raises IncompatibleOptionsError naming why none does."""
    periodic = options.get("outer_step") or options.get("average_every", 1) != 1
    order = dict.fromkeys([*(PERIODIC_PREFERENCE if periodic else PREFERENCE), *FAMILIES])
    refusals = []
    for spec in order:
        if spec.partition(":")[0] not in FAMILIES:
            continue
        candidate = Algorithm.parse(spec)
        try:
            candidate.check(**options)
        except IncompatibleOptionsError as exc:
            refusals.append(f"{spec}: {exc}")
            continue
        return candidate
    raise IncompatibleOptionsError(f"algorithm={AUTO} found none that works here ({'; '.join(refusals)})")


def choose_local_steps(**options: Any) -> int | None:
    """``auto``'s local steps: :data:`AUTO_LOCAL_STEPS` over :data:`LOCAL_STEPS_ALGORITHM`
    where ``options`` (:meth:`Algorithm.check`'s) ask for no averaging period, outer step,
    codec, robust rule or directed graph of their own and allow an outer step; else None
    (every step)."""
    codec, topology = options.get("codec"), options.get("topology")
    if (
        options.get("outer_step")
        or options.get("average_every", 1) != 1
        or options.get("robust") is not None
        or (codec is not None and codec.name != "none")
        or (topology is not None and topology.family.directed)  # (push-sum's: SGP's per step)
    ):
        return None
    try:
        Algorithm.parse(LOCAL_STEPS_ALGORITHM).check(
            **{**options, "average_every": AUTO_LOCAL_STEPS, "outer_step": True}
        )
    except IncompatibleOptionsError:
        return None
    return AUTO_LOCAL_STEPS


def _having(need: str) -> str:
    """The algorithms whose class declares ``need``, as ``a or b``."""
    return " or ".join(name for name, family in FAMILIES.items() if getattr(family.averager.needs, need))

"""Option values: the parsers (text in, a typed value out, or a ValueError saying what is
expected), and the typed values no other package owns (fault schedules, corruptions, per-node
values of a local mesh).

The config layer (``gossipmesh.config.sources``) prefixes a message with where the text came
from (``--kill``, ``GOSSIPMESH_LISTEN``, ``node.toml: bootstrap``), so none of these name a flag.
Numbers and named choices use ``topologies.spec`` (``number``, ``choice``, ``Spec.parse``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

import numpy as np

from gossip import Algorithm, RobustRule
from gossip.algorithms.registry import AUTO
from gossipmesh.sim.allreduce import RingAllreduce
from gossipmesh.sim.links import Partition
from gossipmesh.sim.scenario import Stragglers
from p2p.address import check_node_id, parse_endpoint
from topologies.spec import Params, Spec, SpecError, number

Value = TypeVar("Value")


@dataclass(frozen=True, order=True)
class ChaosAction:
    """A scheduled fault of a local mesh (``--kill 3@10``, ``--leave``, ``--pause 2@5:0.8``,
    ``--join 2@15``) or a simulated one (``--join``); times are seconds on the mesh clock."""

    at: float
    action: str  # kill | leave | pause | resume | join
    rank: int = -1  # the node acted on (kill, leave, pause, resume)
    count: int = 0  # nodes started (join)
    duration: float = 0.0  # how long a pause lasts

    @property
    def flag(self) -> str:
        """The flag that schedules it (a resume is half of a ``--pause``)."""
        return "--pause" if self.action == "resume" else f"--{self.action}"

    def __str__(self) -> str:
        """The flag's spelling of this action (``3@10``, ``2@5:0.8``, ``2@15``)."""
        if self.action == "join":
            return f"{self.count}@{self.at:g}"
        return f"{self.rank}@{self.at:g}" + (f":{self.duration:g}" if self.action == "pause" else "")


def schedule(actions: Iterable[ChaosAction]) -> list[ChaosAction]:
    """The actions in time order, each pause followed by its resume."""
    timed = []
    for action in actions:
        timed.append(action)
        if action.action == "pause":
            timed.append(replace(action, at=action.at + action.duration, action="resume", duration=0.0))
    return sorted(timed)


_CORRUPTIONS = {
    "scale": Params({"factor": number(float)}, positional="factor", required=("factor",)),
    "random": Params({"std": number(float, at_least=0)}, positional="std", required=("std",)),
}


@dataclass(frozen=True)
class Corruption(Spec, what="corruption", choices=_CORRUPTIONS):
    """What a Byzantine node (``--byzantine``) sends instead of its model: ``scale:FACTOR``
    (FACTOR times the model) or ``random:STD`` (Gaussian noise of that deviation)."""

    def apply(self, model: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if self.name == "scale":
            scaled: np.ndarray = model * model.dtype.type(self.options["factor"])
            return scaled
        return rng.normal(0.0, self.options["std"], model.shape).astype(model.dtype)


def endpoint(text: str) -> str:
    """``HOST:PORT`` or ``tcp://HOST:PORT``, as ``tcp://HOST:PORT``."""
    return parse_endpoint(text)


def node_id(text: str) -> str:
    return check_node_id(text)


def robust_rule(text: str) -> RobustRule | None:
    """``none`` (the plain weighted mean), or a rule (``clip``, ``trimmed-mean:b=2``)."""
    return None if text.strip() == "none" else RobustRule.parse(text)


def algorithm(text: str) -> Algorithm | str:
    """An algorithm, or ``auto``: chosen once the other options are known (see
    ``gossip.algorithms.registry.choose_algorithm``; ``Averaging`` resolves it)."""
    if text.strip() == AUTO:
        return AUTO
    try:
        return Algorithm.parse(text)
    except SpecError as exc:
        raise SpecError(f"{exc}; or {AUTO}") from None


def simulated_algorithm(text: str) -> Algorithm | RingAllreduce | str:
    """A gossip algorithm, ``auto``, or ``allreduce``: the simulator's ring-allreduce reference."""
    if text.strip() == str(RingAllreduce()):
        return RingAllreduce()
    try:
        return algorithm(text)
    except SpecError as exc:
        raise SpecError(f"{exc} or allreduce") from None


def key_value(text: str) -> tuple[str, str]:
    """``KEY=VALUE``."""
    key, equals, value = text.partition("=")
    if not (key and equals):
        raise ValueError(f"{text!r}: expected KEY=VALUE, e.g. degree=4")
    return key, value


def device(text: str) -> str:
    """A torch device this machine has: cpu, cuda or cuda:INDEX."""
    name, _, index = text.partition(":")
    if name not in ("cpu", "cuda") or (index and (name == "cpu" or not index.isdigit())):
        raise ValueError(f"{text!r}: choose cpu, cuda or cuda:INDEX")
    if name == "cpu":
        return text
    import torch  # (only to count CUDA devices: the cpu default answers without it)

    available = torch.cuda.device_count()
    if available <= int(index or 0):
        raise ValueError(
            f"{text!r}: this torch build sees no CUDA device {index or 0} ({available} found); "
            "install a CUDA build (make venv TORCH_SPEC=...) or use --device cpu"
        )
    return text


@dataclass(frozen=True)
class ForRank(Generic[Value]):
    """A value for one node of a local mesh: ``RANK:VALUE``."""

    rank: int
    value: Value
    text: str = field(compare=False)  # VALUE as it was written

    def __str__(self) -> str:
        return f"{self.rank}:{self.text}"


def per_rank(parse: Callable[[str], Value], what: str, example: str) -> Callable[[str], ForRank[Value]]:
    """A parser of ``RANK:VALUE``, the value read by ``parse``."""

    def parse_rank(text: str) -> ForRank[Value]:
        rank, colon, value = text.partition(":")
        if not (colon and rank.isdigit()):
            raise ValueError(f"{text!r}: expected RANK:{what}, e.g. {example}")
        try:
            return ForRank(int(rank), parse(value), value)
        except ValueError as exc:
            raise ValueError(f"{text!r}: {exc}") from None

    return parse_rank


def timed(text: str, separator: str, form: str, example: str) -> tuple[str, float]:
    """``WHAT<separator>SECONDS`` as (WHAT, seconds >= 0)."""
    what, found, at = text.partition(separator)
    seconds = _float(at) if found else math.nan
    if not (found and math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{text!r}: expected {form} with seconds >= 0, e.g. {example}")
    return what, seconds


def kill(text: str) -> ChaosAction:
    rank, at = timed(text, "@", "RANK@SECONDS", "3@10")
    return ChaosAction(at, "kill", rank=_whole(rank, text))


def leave(text: str) -> ChaosAction:
    rank, at = timed(text, "@", "RANK@SECONDS", "3@10")
    return ChaosAction(at, "leave", rank=_whole(rank, text))


def join(text: str) -> ChaosAction:
    count, at = timed(text, "@", "COUNT@SECONDS", "2@15")
    joined = _whole(count, text)
    if joined < 1:
        raise ValueError(f"{text!r}: COUNT must be >= 1")
    return ChaosAction(at, "join", count=joined)


@dataclass(frozen=True)
class Link:
    """A bandwidth cap of a local mesh: ``MBPS`` on every node's uplink, ``RANK:MBPS`` on one's."""

    rank: int | None
    mbps: float

    def __str__(self) -> str:
        return f"{self.mbps:g}" if self.rank is None else f"{self.rank}:{self.mbps:g}"


def uplink_mbps(caps: Sequence[Link], rank: int | None) -> float | None:
    """Node ``rank``'s uplink cap among ``caps``: its own, else the one of every node, else none
    (``rank`` None: the one of every node)."""
    by_rank = {cap.rank: cap.mbps for cap in caps}
    return by_rank.get(rank, by_rank.get(None))


def link(text: str) -> Link:
    rank, colon, rate = text.rpartition(":")
    mbps = _float(rate)
    if (colon and not rank.isdigit()) or not (math.isfinite(mbps) and mbps > 0):
        raise ValueError(f"{text!r}: expected MBPS or RANK:MBPS with MBPS > 0, e.g. 100 or 3:10")
    return Link(int(rank) if colon else None, mbps)


def pause(text: str) -> ChaosAction:
    """``RANK@SECONDS:DURATION``: SIGSTOP, then SIGCONT DURATION s later."""
    rank, _, when = text.partition("@")
    start, found, duration = when.partition(":")
    at, length = _float(start), _float(duration)
    if not (found and all(math.isfinite(v) and v >= 0 for v in (at, length))):
        raise ValueError(f"{text!r}: expected RANK@SECONDS:DURATION with seconds >= 0, e.g. 2@5:0.8")
    return ChaosAction(at, "pause", rank=_whole(rank, text), duration=length)


def crash(text: str) -> tuple[float, float]:
    """``FRACTION@SECONDS``: that fraction of a simulated mesh crashes then."""
    fraction, at = timed(text, "@", "FRACTION@SECONDS", "0.1@2")
    return number(float, above=0, at_most=1)(fraction), at


def window(text: str) -> Partition:
    """``START:END``: a simulated network split from START to END virtual seconds (the two
    sides are filled in by the simulator from the node count)."""
    start, end = timed(text, ":", "START:END", "1:4")
    begin = _float(start)
    if not (math.isfinite(begin) and 0 <= begin < end):
        raise ValueError(f"{text!r}: need 0 <= START < END, e.g. 1:4 (healed at 4 s)")
    return Partition(begin, end, frozenset())


def stragglers(text: str) -> Stragglers:
    """``FRACTION:FACTOR``, e.g. ``0.05:4`` (5% of the nodes 4x slower)."""
    fraction, factor = text.partition(":")[::2]
    try:
        value = Stragglers(float(fraction), float(factor))
    except ValueError:
        value = Stragglers(math.nan, math.nan)
    if not (0 <= value.fraction <= 1 and value.factor >= 1):
        raise ValueError(
            f"{text!r}: expected FRACTION:FACTOR with FRACTION in [0, 1] and FACTOR >= 1, "
            "e.g. 0.05:4 for 5% of the nodes 4x slower"
        )
    return value


def _whole(text: str, whole: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{whole!r}: {text!r} is not a whole number") from None
    if value < 0:
        raise ValueError(f"{whole!r}: {value} must be >= 0")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan

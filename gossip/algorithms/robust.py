"""Byzantine-robust mixing rules for D-PSGD: what replaces ``x_i = sum_j W_ij x_j`` when some
neighbours may send arbitrary models.

``clip`` is self-centred clipping (ClippedGossip; He, Karimireddy & Jaggi 2022): node i moves
towards each neighbour by its mixing weight, but by at most ``tau`` in norm::

    x_i <- x_i + sum_j W_ij * clip(x_j - x_i, tau),   clip(z, tau) = z * min(1, tau / ||z||)

so a neighbour, however wrong, moves i by at most ``W_ij * tau`` per round. ``tau`` adapts each
round: the distance to the ``(d - b)``-th closest of the ``d`` neighbours whose values arrived
(``b``: how many bad neighbours to tolerate), so the ``b`` farthest are clipped to that radius
and the others pass untouched. With ``b`` or fewer arrivals none can be told from a bad one:
``tau`` is 0 and node i stays where it is.

``trimmed-mean`` is the coordinate-wise trimmed mean (BRIDGE; Yang & Bajwa 2019): for every
coordinate, of i's own value and its neighbours', the ``b`` largest and ``b`` smallest are
dropped and the rest averaged (with equal weights). With ``2b`` values or fewer (neighbours
fell silent) that would drop them all: node i keeps its own value.

So both rules are defined for any number of arrivals, and neither lets ``b`` neighbours move a
node that hears from no more than ``b``.

Both cost a few model-sized temporaries per round; they are for meshes where a trusted node may
still be faulty or compromised. CURVE keeps strangers out; these keep a bad insider's influence
bounded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from topologies.spec import Params, format_spec, number, parse_spec

_RULE = Params({"b": number(int, at_least=0)})
RULES = {"clip": _RULE, "trimmed-mean": _RULE}


class RobustError(ValueError):
    """A robust rule that cannot mix what it was given (too few values to trim)."""


@dataclass(frozen=True)
class RobustRule:
    """A mixing rule and ``b``, the number of bad neighbours it tolerates."""

    name: str
    tolerate: int = 1

    @classmethod
    def parse(cls, spec: str) -> RobustRule:
        """``clip`` or ``trimmed-mean``, optionally ``:b=K`` (default 1); raises SpecError."""
        name, params = parse_spec(spec, RULES, "robust rule")
        return cls(name, params.get("b", 1))

    def __str__(self) -> str:
        return format_spec(self.name, {"b": self.tolerate}, RULES[self.name])

    def mix(
        self, own: np.ndarray, neighbours: Mapping[str, tuple[np.ndarray, float]], out: np.ndarray
    ) -> None:
        """Write into ``out`` the mix of ``own`` with ``neighbours`` (id -> (value, weight))."""
        if not neighbours:
            np.copyto(out, own)
        elif self.name == "clip":
            clipped_gossip(own, neighbours, self.tolerate, out)
        else:
            trimmed_mean(own, [value for value, _ in neighbours.values()], self.tolerate, out)


def clipped_gossip(
    own: np.ndarray, neighbours: Mapping[str, tuple[np.ndarray, float]], tolerate: int, out: np.ndarray
) -> None:
    """Self-centred clipping with the adaptive radius described in the module docstring."""
    differences = {j: value.astype(np.float64) - own for j, (value, _) in neighbours.items()}
    distances = {j: float(np.linalg.norm(d)) for j, d in differences.items()}
    ranked = sorted(distances.values())
    tau = ranked[len(ranked) - tolerate - 1] if len(ranked) > tolerate else 0.0
    step = np.zeros(own.shape, np.float64)
    for j, difference in differences.items():
        scale = 1.0 if distances[j] <= tau else tau / distances[j]
        step += neighbours[j][1] * scale * difference
    np.add(own, step, out=out, casting="unsafe")


def trimmed_mean(own: np.ndarray, values: list[np.ndarray], tolerate: int, out: np.ndarray) -> None:
    """Coordinate-wise mean of ``own`` and ``values`` without the ``tolerate`` extremes at each
    end; ``own`` when that would leave nothing."""
    if len(values) + 1 <= 2 * tolerate:
        np.copyto(out, own)
        return
    stacked = np.sort(np.stack([own, *values]), axis=0)
    np.mean(stacked[tolerate : stacked.shape[0] - tolerate], axis=0, out=out)

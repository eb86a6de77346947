"""The outer optimizer of local-steps training (DiLoCo, Douillard et al. 2023).

A node takes H inner steps, gossip mixes the resulting parameters with its neighbours', and the
change since the last outer step, the pseudo-gradient g = anchor - mixed, is applied to the
anchor by SGD with Nesterov momentum:

    v <- μ v + g;    anchor <- anchor - lr (g + μ v);    params <- anchor

Mixing the parameters (rather than the deltas alone) keeps the nodes' anchors together: where
anchors already agree, mixed - anchor is the neighbourhood's average delta, as in DiLoCo; where
they drift, it also pulls them back. With lr = 1 and μ = 0 this is plain local SGD with gossip.

The outer momentum extrapolates: on a steady pseudo-gradient the anchor moves lr (1 + μ / (1 - μ))
times it (7x with lr 0.7, μ 0.9), which the average of a neighbourhood's progress bears and one
node's own does not. A round that mixed in fewer than ``MIN_MIXED_SHARE`` of the values it expected
(its neighbours' fell behind or their link is slow), or had no neighbour to mix with (they left,
or the mesh is this node alone), therefore takes the parameters as they are for the new anchor,
keeping the momentum, as plain local SGD would: a node cut off from its neighbours trains on
alone instead of overshooting on its own steps (with the outer step every round, such a node of
a local-steps mesh behind a 10 Mbit/s link went from 0.9 to 0.097; a straggler left alone for
its last 240 steps, from loss 0.39 to 1.78). Where
the algorithm mixes a round late (``overlap``), the outer step comes before the round's mixing,
on the node's own progress, and the round before decides it.

A straggler's round that caught up with the mesh (skipped to the round after its neighbours',
``catch_up``) takes the mixed parameters as its anchor too: they hold the mesh's progress over the
rounds it skipped, which the neighbours' own outer steps have extrapolated already, and its
pseudo-gradient, spanning those rounds, would be extrapolated again. With one node of 8 four times
slower (``bench/stragglers.py``), every node reached 0.95 in 7.4 s instead of 8.2-9.3.
"""

from __future__ import annotations

import numpy as np

from gossip.buffers.vector import add_scaled, scratch_for

MIN_LOCAL_STEPS = 10  # fewer inner steps a round, and the outer momentum compounds the inner one
MIN_MIXED_SHARE = 0.5  # of the values a round expected, for it to take the outer step (see above)


class OuterNesterov:
    def __init__(self, params: np.ndarray, *, lr: float = 0.7, momentum: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"the outer learning rate must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"the outer momentum must be in [0, 1), got {momentum}")
        self.lr = lr
        self.momentum = momentum
        self.anchor = params.copy()
        self.velocity = np.zeros_like(params)
        self._scratch = scratch_for(params)
        self.rounds_held = 0  # rounds that took no outer step: mixed too little, or caught up

    def step(self, params: np.ndarray) -> None:
        """Apply the pseudo-gradient ``anchor - params`` to the anchor; write it to ``params``."""
        gradient = np.subtract(self.anchor, params, out=params)  # params is overwritten below
        self.velocity *= self.momentum
        self.velocity += gradient
        add_scaled(gradient, self.velocity, self.momentum, self._scratch)
        add_scaled(self.anchor, gradient, -self.lr, self._scratch)
        np.copyto(params, self.anchor)

    def after_mixing(self, params: np.ndarray, expected: int, arrived: int, caught_up: bool = False) -> bool:
        """The outer step on a round that mixed ``arrived`` of the ``expected`` neighbours'
        values, or, with none expected, below ``MIN_MIXED_SHARE`` of them or on a round that
        ``caught_up`` with the mesh (see above), the anchor moved to ``params``; whether the
        step was taken."""
        if caught_up or not expected or arrived < MIN_MIXED_SHARE * expected:
            self.move_anchor(params)
            self.rounds_held += 1
            return False
        self.step(params)
        return True

    def move_anchor(self, params: np.ndarray) -> None:
        """Take ``params`` as the anchor, keeping the momentum (after mixing moved them)."""
        np.copyto(self.anchor, params)

    def reset(self, params: np.ndarray) -> None:
        """Start again from ``params`` (after taking another node's state)."""
        np.copyto(self.anchor, params)
        self.velocity.fill(0.0)

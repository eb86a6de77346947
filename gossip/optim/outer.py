"""The outer optimizer of local-steps training (DiLoCo, Douillard et al. 2023).

A node takes H inner steps, gossip mixes the resulting parameters with its neighbours', and the
change since the last outer step, the pseudo-gradient g = anchor - mixed, is applied to the
anchor by SGD with Nesterov momentum:

    v <- μ v + g;    anchor <- anchor - lr (g + μ v);    params <- anchor

Mixing the parameters (rather than the deltas alone) keeps the nodes' anchors together: where
anchors already agree, mixed - anchor is the neighbourhood's average delta, as in DiLoCo; where
they drift, it also pulls them back. With lr = 1 and μ = 0 this is plain local SGD with gossip.
"""

from __future__ import annotations

import numpy as np

from gossip.buffers.vector import add_scaled, scratch_for

MIN_LOCAL_STEPS = 10  # fewer inner steps a round, and the outer momentum compounds the inner one


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

    def step(self, params: np.ndarray) -> None:
        """Apply the pseudo-gradient ``anchor - params`` to the anchor; write it to ``params``."""
        gradient = np.subtract(self.anchor, params, out=params)  # params is overwritten below
        self.velocity *= self.momentum
        self.velocity += gradient
        add_scaled(gradient, self.velocity, self.momentum, self._scratch)
        add_scaled(self.anchor, gradient, -self.lr, self._scratch)
        np.copyto(params, self.anchor)

    def move_anchor(self, params: np.ndarray) -> None:
        """Take ``params`` as the anchor, keeping the momentum (after mixing moved them)."""
        np.copyto(self.anchor, params)

    def reset(self, params: np.ndarray) -> None:
        """Start again from ``params`` (after taking another node's state)."""
        np.copyto(self.anchor, params)
        self.velocity.fill(0.0)

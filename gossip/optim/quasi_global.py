"""Quasi-global momentum (QG-DSGDm, Lin et al. 2021, "Quasi-Global Momentum: Accelerating
Decentralized Deep Learning on Heterogeneous Data"): heavy-ball momentum on how the model moved,
mixing included, instead of on the local gradients.

Local momentum on heterogeneous data (each node's labels skewed) amplifies each node's pull
towards its own optimum by 1 / (1 - β) before gossip can pull it back. Here the buffer follows
the model's movement from one step to the next, the neighbours' pull included, so it tracks the
mesh's common direction:

    u <- β u + (1 - β) (x_previous - x);   x_previous <- x;   (local step);   x <- x - β u

``u`` is in parameter units: the paper's buffer times the learning rate (the same for a constant
one), so the momentum step goes on top of any local optimizer (plain SGD without momentum is the
paper's). Buffers are kept on the model's device, in float32 for a narrower model.
"""

from __future__ import annotations

import torch

NARROW = (torch.bfloat16, torch.float16)


class QuasiGlobalMomentum:
    """The buffers of one model's flat buckets (see ``gossip.buffers.flat``)."""

    def __init__(self, buckets: list[torch.Tensor], beta: float) -> None:
        if not 0 < beta < 1:
            raise ValueError(f"the quasi-global momentum must be in (0, 1), got {beta}")
        self.beta = beta
        self._previous = [_wide_copy(b) for b in buckets]
        self.velocity = [torch.zeros_like(p) for p in self._previous]
        self._buckets = buckets

    def before_step(self) -> None:
        """Fold the movement since the last step (its local step and any mixing) into ``u``."""
        for bucket, previous, velocity in zip(self._buckets, self._previous, self.velocity, strict=True):
            previous.sub_(bucket)  # x_previous - x
            velocity.mul_(self.beta).add_(previous, alpha=1 - self.beta)
            previous.copy_(bucket)

    def after_step(self) -> None:
        """The momentum step, after the local optimizer's."""
        for bucket, velocity in zip(self._buckets, self.velocity, strict=True):
            bucket.sub_(velocity, alpha=self.beta)  # (rounded once into a narrower bucket)

    def restart(self) -> None:
        """Start again from the model as it is (after taking another node's state): no movement."""
        for bucket, previous, velocity in zip(self._buckets, self._previous, self.velocity, strict=True):
            previous.copy_(bucket)
            velocity.zero_()


def _wide_copy(bucket: torch.Tensor) -> torch.Tensor:
    return bucket.detach().to(torch.float32 if bucket.dtype in NARROW else bucket.dtype, copy=True)

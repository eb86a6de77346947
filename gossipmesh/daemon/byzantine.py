"""A Byzantine node, for tests and benchmarks of robust mixing: it trains like any other node,
but every model it sends to a neighbour is corrupted (``--byzantine scale:FACTOR`` sends
FACTOR times its model, ``--byzantine random:STD`` Gaussian noise of that deviation). It stays
within the wire format and the finiteness checks, so only the mixing rule can stop it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gossip.network import PeerNetwork, PeerWrapper
from gossipmesh.config.values import Corruption

# what carries a model (AD-PSGD's answer: half a difference of two, so scale:F moves its active
# by F times what it should, and scale:0 not at all)
MODEL_KINDS = frozenset({"params", "push", "pair_model", "pair_difference"})


class ByzantinePeer(PeerWrapper):
    """A ``PeerNetwork`` that corrupts the models sent through it and passes the rest on."""

    def __init__(self, peer: PeerNetwork, corruption: Corruption, seed: int = 0) -> None:
        super().__init__(peer)
        self._corruption = corruption
        self._rng = np.random.default_rng(seed)

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        if kind in MODEL_KINDS and tensors:
            tensors = [self._corruption.apply(tensors[0], self._rng), *tensors[1:]]
        self._peer.send(to, kind, round, tensors, meta)

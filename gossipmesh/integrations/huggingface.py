"""Hugging Face ``transformers.Trainer`` on a mesh: the trainer steps a ``GossipOptimizer``
given as its optimizer, and :class:`GossipCallback` adds gossip's figures to the trainer's logs
and leaves the mesh when training ends::

    optimizer = GossipOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), peer=peer, model=model)
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, 10, max_steps)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizers=(optimizer, scheduler),
                                   callbacks=[GossipCallback(optimizer, peer)])

Build the optimizer after the model is on its device (it moves the parameters into flat
buffers there); a schedule, gradient clipping (``max_grad_norm``), gradient accumulation and
``bf16=True`` act on the local step as with any torch optimizer.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from gossip import GossipOptimizer
from p2p import Peer


class GossipCallback(TrainerCallback):
    """Logs ``gossip_round`` and ``gossip_consensus`` beside the loss; on a GPU lets each
    forward pass overlap the upload of the parameters mixed in the last round; at the end of
    training mixes the final models once more with the neighbours' (``GossipOptimizer.finish``),
    stops the optimizer's background work and leaves the mesh after its last round."""

    def __init__(self, optimizer: GossipOptimizer, peer: Peer) -> None:
        self.optimizer = optimizer
        self.peer = peer

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if model is not None:  # on a GPU: the next forward pass overlaps the upload after a round
            self.optimizer.overlap_upload(model)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is not None:
            statistics = self.optimizer.statistics()
            logs["gossip_round"] = statistics.round
            if statistics.consensus is not None:
                logs["gossip_consensus"] = statistics.consensus

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.optimizer.finish()
        self.optimizer.close()
        self.peer.leave(after_round=self.optimizer.round - 1)

"""A Hugging Face ``Trainer`` on a mesh: a tiny GPT-2, built from its config (nothing is
downloaded), learns the characters of Python's own help pages, each node on its share of them.

Two nodes (options are those of ``gossipmesh node``: flags, GOSSIPMESH_* or --config)::

    gossipmesh keygen /tmp/keys --name mesh
    python examples/hf_trainer.py --listen tcp://127.0.0.1:7001 --expect 2 \
        --keys /tmp/keys --trusted /tmp/keys --steps 200 &
    python examples/hf_trainer.py --listen tcp://127.0.0.1:7002 --expect 2 \
        --keys /tmp/keys --trusted /tmp/keys --steps 200 --bootstrap tcp://127.0.0.1:7001

Needs ``pip install transformers accelerate`` (the test extra has them).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import transformers

import gossipmesh
from gossipmesh.integrations.huggingface import GossipCallback
from gossipmesh.tasks.charlm import CONTEXT, VOCAB_SIZE, encode, pydoc_topics

HELD_OUT = 64  # windows every node evaluates on


class Windows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Windows of CONTEXT tokens; a causal LM's labels are its inputs (the model shifts them)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = torch.from_numpy(tokens.reshape(-1, CONTEXT))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def datasets(rank: int, nodes: int) -> tuple[Windows, Windows]:
    """This node's training windows (every nodes-th one) and the held-out windows all share."""
    tokens = encode("".join(pydoc_topics()))
    windows = tokens[: len(tokens) // CONTEXT * CONTEXT].reshape(-1, CONTEXT)
    return Windows(windows[HELD_OUT + rank :: nodes]), Windows(windows[:HELD_OUT])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train one node with transformers.Trainer; print and return its figures."""
    config = gossipmesh.node_config(argv)
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)  # the same initial model on every node
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB_SIZE, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4)
    )
    peer = gossipmesh.connect(config, model)
    members = gossipmesh.member_order(peer.members())
    train, held_out = datasets(members.index(peer.node_id), len(members))
    steps = config.steps or 100
    optimizer = config.gossip_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), peer, model=model)
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, steps // 10, steps)
    with tempfile.TemporaryDirectory() as output:
        args = transformers.TrainingArguments(
            output_dir=output,
            max_steps=steps,
            per_device_train_batch_size=config.batch_size,
            max_grad_norm=1.0,
            logging_steps=max(1, steps // 4),
            save_strategy="no",
            report_to=[],
            use_cpu=config.device == "cpu",
            seed=config.seed,
            data_seed=config.seed + members.index(peer.node_id),
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=train,
            eval_dataset=held_out,
            optimizers=(optimizer, scheduler),
            callbacks=[GossipCallback(optimizer, peer)],
        )
        before = trainer.evaluate()["eval_loss"]
        trainer.train()
        after = trainer.evaluate()["eval_loss"]
    peer.close()
    if config.save_params is not None:
        np.save(config.save_params, gossipmesh.host_vector(model.parameters()))
    summary = {
        "id": peer.node_id,
        "rounds": optimizer.round,
        "lr_at_end": optimizer.param_groups[0]["lr"],
        "loss_before": before,
        "loss_after": after,
        "uniform_loss": math.log(VOCAB_SIZE),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

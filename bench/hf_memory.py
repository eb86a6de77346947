"""An unmodified Hugging Face Trainer with and without gossip, side by side: peak memory and
step time of a GPT-2 of 12 layers of width 768 (built from its config, nothing downloaded) on
the characters of Python's own help pages.

Two arms, each two fresh processes on 127.0.0.1 (one torch thread each: they share the cores):

- ``alone``: each process trains its own model with the Trainer and AdamW, no gossip;
- ``gossip``: the two processes are a mesh (``gossipmesh.connect``, D-PSGD, --insecure), the
  Trainer steps a ``GossipOptimizer`` around the same AdamW (``GossipCallback``).

Per arm: the model's bytes, each process's peak resident memory (VmHWM) and the median time of
a training step after the first two, and for gossip its peak over the alone arm's.

    python bench/hf_memory.py [--steps 24] [--layers 12] [--width 768] [--batch 4] [--repeats 1]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import transformers
from forked import run_forked

import gossipmesh
from gossipmesh.config import NodeConfig, load
from gossipmesh.integrations.huggingface import GossipCallback
from gossipmesh.tasks.charlm import CONTEXT, VOCAB_SIZE, encode, pydoc_topics
from p2p.address import free_ports

WARMUP = 2  # steps left out of the step time (the first builds the optimizer's state)


class Windows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Windows of CONTEXT characters; a causal LM's labels are its inputs."""

    def __init__(self, rank: int, nodes: int) -> None:
        tokens = torch.from_numpy(encode("".join(pydoc_topics())))
        self.windows = tokens[: len(tokens) // CONTEXT * CONTEXT].reshape(-1, CONTEXT)[rank::nodes]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


class StepTimes(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._started = 0.0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self._started = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter() - self._started)


def peak_rss() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def _run(arm: str, rank: int, ports: list[int], args: argparse.Namespace, out: Connection) -> None:
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB_SIZE, n_positions=CONTEXT, n_embd=args.width, n_layer=args.layers, n_head=12
        )
    )
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    callbacks: list[transformers.TrainerCallback] = [times := StepTimes()]
    peer = None
    if arm == "gossip":
        contact = {"bootstrap": [f"tcp://127.0.0.1:{ports[0]}"]} if rank else {}
        flags = {"insecure": True, "listen": f"tcp://127.0.0.1:{ports[rank]}", "expect": "2",
                 "id": f"node-{rank}", "algorithm": "dpsgd", **contact}  # fmt: skip
        config = load(NodeConfig, flags)
        peer = gossipmesh.connect(config, model)
        optimizer = config.gossip_optimizer(optimizer, peer, model=model)
        callbacks.append(GossipCallback(optimizer, peer))  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as output:
        training = transformers.TrainingArguments(
            output_dir=output, max_steps=args.steps, per_device_train_batch_size=args.batch,
            save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=args.steps,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=model,
            args=training,
            train_dataset=Windows(rank, 2),
            optimizers=(optimizer, None),
            callbacks=callbacks,
        )
        trainer.train()
    if peer is not None:
        peer.close()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out.send(
        {"peak": peak_rss(), "step_s": statistics.median(times.times[WARMUP:]), "model_bytes": model_bytes}
    )


def run_arm(arm: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    ports = free_ports(2)
    result: list[dict[str, Any]] = run_forked(2, _run, lambda rank: (arm, rank, ports, args))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=4, help="windows of 32 characters per step")
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="runs of both arms, one after the other; the step-time ratio is their median (a step "
        "of the alone arm varies by 10%% between runs on a shared machine)",
    )  # fmt: skip
    args = parser.parse_args()
    ratios, overs = [], []
    for repeat in range(args.repeats):
        alone, gossip = run_arm("alone", args), run_arm("gossip", args)
        if repeat == 0:
            model_mb = alone[0]["model_bytes"] / 1e6
            print(f"GPT-2 {args.layers} x {args.width}: {model_mb:.0f} MB of parameters, {args.steps} steps, "
                  f"batch {args.batch} x {CONTEXT} characters, 2 processes")  # fmt: skip
            print(f"{'arm':>7} {'peak MB':>16} {'step s':>14} {'peak over alone':>24}")
        ratio, over = _print_run(alone, gossip)
        ratios.append(ratio)
        overs.append(over)
    if args.repeats > 1:
        print(f"median of {args.repeats} runs: step time {statistics.median(ratios):.2f}x alone's, "
              f"peak over alone {statistics.median(overs):.2f}x the model")  # fmt: skip


def _print_run(alone: list[dict[str, Any]], gossip: list[dict[str, Any]]) -> tuple[float, float]:
    """Print one run of both arms; its gossip step time over alone's and peak over alone's (x
    the model)."""
    model_mb = alone[0]["model_bytes"] / 1e6
    base = max(r["peak"] for r in alone)
    for name, rows in (("alone", alone), ("gossip", gossip)):
        peaks = " / ".join(f"{r['peak'] / 1e6:.0f}" for r in rows)
        steps = " / ".join(f"{r['step_s']:.2f}" for r in rows)
        over = max(r["peak"] for r in rows) - base
        print(f"{name:>7} {peaks:>16} {steps:>14} {over / 1e6:>9.0f} MB = {over / 1e6 / model_mb:.2f}x model")
    ratio = statistics.median(r["step_s"] for r in gossip) / statistics.median(r["step_s"] for r in alone)
    print(f"gossip's step time: {ratio:.2f}x alone's", flush=True)
    return ratio, over / 1e6 / model_mb


if __name__ == "__main__":
    main()

"""A plain PyTorch loop as users write them, on two processes: bfloat16 parameters, AdamW, a
cosine schedule, gradient clipping and a state-dict round trip midway, against the same loop
run locally on all the data."""

from __future__ import annotations

import io
import json
import multiprocessing
from pathlib import Path

import pytest
import torch
from helpers import HANG_S, addresses

import gossipmesh
from gossipmesh.tasks import IID, Batches, Precision
from gossipmesh.tasks.digits import DigitsTask

STEPS = 300
BATCH = 32  # per node; the local loop takes both nodes' worth per step
LR = 3e-3


def _loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Batches) -> list[float]:
    """The loop: what the schedule said at each step, and a round trip of both state dicts (as
    a checkpoint through bytes would) halfway."""
    task = DigitsTask()
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    precision = Precision("bfloat16")
    rates = []
    for step, (inputs, targets) in zip(range(STEPS), batches, strict=False):
        if step == STEPS // 2:
            saved = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
            saved.seek(0)
            state = torch.load(saved)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        with precision.autocast(torch.device("cpu")):
            loss = task.loss(model, inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def _evaluate(model: torch.nn.Module) -> float:
    with Precision("bfloat16").autocast(torch.device("cpu")):
        return DigitsTask().evaluate(model).accuracy


def _node(argv: list[str], result: Path) -> None:
    torch.set_num_threads(1)
    config = gossipmesh.node_config(argv)
    task = DigitsTask()
    model = Precision("bfloat16").apply(task.model(0))
    peer = gossipmesh.connect(config, model)
    rank = gossipmesh.member_order(peer.members()).index(peer.node_id)
    optimizer = gossipmesh.GossipOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), peer=peer)
    rates = _loop(model, optimizer, Batches(task.shard(rank, 2, partition=IID, seed=0), BATCH, seed=rank))
    optimizer.close()
    peer.leave(after_round=optimizer.round - 1)
    peer.close()
    local_rates = [group["lr"] for group in optimizer.optimizer.param_groups]
    result.write_text(json.dumps({"accuracy": _evaluate(model), "rates": rates, "inner": local_rates}))


@pytest.mark.mesh
def test_a_users_bfloat16_loop_on_two_nodes_matches_the_local_loop(
    tmp_path: Path, no_other_threads: None
) -> None:
    task = DigitsTask()
    local = Precision("bfloat16").apply(task.model(0))
    adamw = torch.optim.AdamW(local.parameters(), lr=LR)
    local_rates = _loop(local, adamw, Batches(task.shard(0, 1, partition=IID, seed=0), 2 * BATCH, seed=0))
    fork = multiprocessing.get_context("fork")
    listen = addresses(2)
    processes = []
    for rank, address in enumerate(listen):
        argv = [
            "--listen",
            address,
            "--expect",
            "2",
            "--insecure",
            *(["--bootstrap", listen[0]] if rank else []),
        ]
        processes.append(fork.Process(target=_node, args=(argv, tmp_path / f"{rank}.json")))
        processes[-1].start()
    for process in processes:
        process.join(timeout=HANG_S)
        assert process.exitcode == 0
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for result in results:
        assert result["rates"] == pytest.approx(local_rates)  # the schedule's rate, step by step
        assert result["inner"] == pytest.approx([adamw.param_groups[0]["lr"]])  # the wrapped one's too
        assert result["accuracy"] >= _evaluate(local) - 0.02, (result["accuracy"], _evaluate(local))

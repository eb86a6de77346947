"""Hugging Face's Trainer drives a GossipOptimizer: a tiny GPT-2 (built from its config) trains
on two nodes of a mesh, each in its own process."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
from helpers import HANG_S, addresses, run_example

from gossip import consensus_distance
from gossip.algorithms.registry import AUTO_LOCAL_STEPS
from p2p.security.curve import keygen

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"
STEPS = 60


@pytest.mark.mesh
def test_a_hugging_face_trainer_trains_a_gpt2_on_two_nodes(tmp_path: Path, no_other_threads: None) -> None:
    fork = multiprocessing.get_context("fork")
    listen = addresses(2)
    keys = tmp_path / "keys"
    keygen(keys, "mesh")
    processes = []
    for rank, address in enumerate(listen):
        argv = ["--listen", address, "--expect", "2", "--steps", str(STEPS), "--batch-size", "16",
                "--threads", "1", "--keys", str(keys), "--trusted", str(keys),
                "--save-params", str(tmp_path / f"{rank}.npy"),
                *(["--bootstrap", listen[0]] if rank else [])]  # fmt: skip
        processes.append(fork.Process(target=run_example, args=(EXAMPLE, argv, tmp_path / f"{rank}.json")))
        processes[-1].start()
    for process in processes:
        process.join(timeout=HANG_S)
        assert process.exitcode == 0
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for result in results:
        # the trainer stepped the gossip optimizer every step: the default mixes every 10th
        assert result["rounds"] == STEPS // AUTO_LOCAL_STEPS
        assert result["lr_at_end"] == pytest.approx(0.0, abs=1e-6)  # the cosine schedule reached it
        assert result["loss_before"] > 0.95 * result["uniform_loss"]  # 4.57 nats: guessing
        assert result["loss_after"] < 0.75 * result["loss_before"], result
    params = [np.load(tmp_path / f"{rank}.npy") for rank in range(2)]
    assert consensus_distance(params) < 0.05  # two shards, one model

"""A user's loop in ``gossipmesh.Session``: start together, a late joiner that takes the state
with no code of its own, leaving cleanly, checkpoints and resuming."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import HANG_S, addresses, started_peers

import gossipmesh
from gossipmesh import Batches, NodeConfig, Session
from gossipmesh.daemon.lifecycle import share_cores
from gossipmesh.tasks.digits import DigitsTask

pytestmark = pytest.mark.usefixtures("no_other_threads")


def _config(**options: object) -> NodeConfig:
    return NodeConfig(insecure=True, progress="none", **options)  # type: ignore[arg-type]


def _train(session: Session, task: DigitsTask, model: torch.nn.Module, steps: int, shards: int) -> None:
    shard = task.shard(session.rank % shards, shards, partition=gossipmesh.IID, seed=0)
    for step, (inputs, targets) in enumerate(Batches(shard, 32, seed=session.rank)):
        if step == steps:
            return
        loss = task.loss(model, inputs, targets)
        session.optimizer.zero_grad()
        loss.backward()
        session.optimizer.step()


def test_two_start_together_a_third_joins_with_their_state_and_all_leave_cleanly() -> None:
    task = DigitsTask()
    first, second, late = addresses(3)
    configs = [
        _config(id="a", listen=first, expect=2),
        _config(id="b", listen=second, expect=2, bootstrap=[first]),
        _config(id="c", listen=late, bootstrap=[first]),  # no --expect: it joins a running mesh
    ]
    models = [task.model(seed) for seed in range(3)]
    sessions: dict[str, Session] = {}
    halfway, joined, errors = threading.Event(), threading.Event(), []

    def node(i: int, steps: int) -> None:
        try:
            model = models[i]
            with Session(configs[i], model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)) as s:
                sessions[s.node_id] = s
                if i == 2:  # the members train on until it has their state
                    joined.set()
                _train(s, task, model, steps // 2, shards=2)
                if i < 2:
                    halfway.set()
                    assert s.peer.membership.joined.is_set()
                    deadline = time.monotonic() + HANG_S
                    while not joined.is_set() and time.monotonic() < deadline:
                        _train(s, task, model, 10, shards=2)
                _train(s, task, model, steps // 2, shards=2)
        except BaseException as exc:
            errors.append(exc)
            halfway.set()
            joined.set()

    threads = [threading.Thread(target=node, args=(i, 400)) for i in range(2)]
    for thread in threads:
        thread.start()
    assert halfway.wait(HANG_S)
    joiner = threading.Thread(target=node, args=(2, 100))
    joiner.start()
    for thread in [*threads, joiner]:
        thread.join(HANG_S)
    assert not errors, errors
    c = sessions["c"]
    assert c.transfer is not None and c.transfer.bytes == 2 * 4 * sum(
        p.numel() for p in models[2].parameters()
    )
    assert c.transfer.chunks.keys() <= {"a", "b"}
    assert c.optimizer.step_count >= 200 + 100  # it went on from the members' step count
    for i in range(3):
        assert task.evaluate(models[i]).accuracy >= 0.9
    for s in sessions.values():  # every node left: its network is closed, nothing of it runs
        assert s.peer.transport.failure is None and s.optimizer.round > 0


def test_a_session_checkpoints_and_a_new_one_resumes_from_it(tmp_path: Path) -> None:
    task = DigitsTask()
    (listen,) = addresses(1)
    config = _config(id="solo", listen=listen, state_dir=tmp_path, checkpoint_every=10)
    model = task.model(0)
    with Session(config, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)) as session:
        assert session.resumed_from is None and session.transfer is None
        _train(session, task, model, 35, shards=1)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-000000000030.safetensors",
        "checkpoint-000000000035.safetensors",  # the last one, on leaving
    ]
    trained = [p.detach().clone() for p in model.parameters()]
    fresh = task.model(1)
    optimizer = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    with Session(config, fresh, optimizer) as resumed:
        assert resumed.resumed_from == tmp_path / "checkpoint-000000000035.safetensors"
        assert resumed.optimizer.step_count == 35
        for ours, theirs in zip(fresh.parameters(), trained, strict=True):
            torch.testing.assert_close(ours.detach(), theirs, rtol=0, atol=0)
            assert optimizer.state[ours]["momentum_buffer"].abs().sum() > 0


def test_checkpoints_need_a_state_dir() -> None:
    (listen,) = addresses(1)
    model = torch.nn.Linear(2, 1)
    with (
        Session(_config(listen=listen), model, torch.optim.SGD(model.parameters(), lr=0.1)) as session,
        pytest.raises(ValueError, match="checkpoints go to --state-dir"),
    ):
        session.checkpoint()
    assert np.isfinite(session.optimizer.flat.array).all()


def test_members_on_one_machine_share_its_cores_unless_threads_is_given() -> None:
    """torch's default of a thread per core in every process of a mesh on one machine makes them
    wait on each other: each takes its share, and says so."""
    default = torch.get_num_threads()
    cores = os.cpu_count() or 1
    try:
        with started_peers(["a", "b"]) as (a, _):
            members = sorted(a.members())
            assert share_cores(NodeConfig(insecure=True, threads=3), a, members, None) is None
            torch.set_num_threads(cores)
            said = share_cores(NodeConfig(insecure=True), a, members, None)
            assert torch.get_num_threads() == max(1, cores // 2)
            if cores > 1:
                assert said is not None and said.startswith(
                    f"2 processes of the mesh share this machine's {cores}"
                )
            assert share_cores(NodeConfig(insecure=True), a, ["a"], None) is None  # alone on it
    finally:
        torch.set_num_threads(default)

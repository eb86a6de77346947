"""The built-in digits task and data partitioning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gossipmesh.tasks import IID, Batches, DataPartition, load_task, partition_indices
from gossipmesh.tasks.digits import stratified_split


def test_digits_split_is_stratified_80_20_and_fixed() -> None:
    labels = np.repeat(np.arange(10), 50)
    train, test = stratified_split(labels, 0.2, seed=0)
    assert len(test) == 100 and len(train) == 400
    assert np.bincount(labels[test]).tolist() == [10] * 10
    assert not set(train) & set(test)
    np.testing.assert_array_equal(stratified_split(labels, 0.2, seed=0)[1], test)


def test_digits_task_shards_cover_the_training_split() -> None:
    task = load_task("digits")
    shards = [task.shard(rank, 4, partition=IID, seed=0) for rank in range(4)]
    assert sum(len(s) for s in shards) == 1437  # 1797 examples, 360 held out
    assert shards[0].inputs.shape[1] == 64 and float(shards[0].inputs.max()) <= 1.0
    evaluation = task.evaluate(task.model(seed=0))
    assert 0.0 <= evaluation.accuracy < 0.3  # an untrained model guesses
    same = task.model(seed=3).state_dict()
    assert all(torch.equal(v, same[k]) for k, v in task.model(seed=3).state_dict().items())


def test_iid_partition_is_disjoint_and_balanced() -> None:
    labels = np.arange(103) % 10
    parts = partition_indices(labels, 4, IID, seed=1)
    assert sorted(np.concatenate(parts).tolist()) == list(range(103))
    assert {len(p) for p in parts} == {25, 26}


def test_dirichlet_partition_skews_labels() -> None:
    labels = np.repeat(np.arange(10), 100)
    parts = partition_indices(labels, 5, DataPartition.parse("dirichlet:0.1"), seed=0)
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))
    dominant = [np.bincount(labels[p], minlength=10).max() / max(len(p), 1) for p in parts if len(p)]
    assert np.mean(dominant) > 0.4  # iid would give ~0.1


def test_batches_cycle_through_the_shard() -> None:
    task = load_task("digits")
    shard = task.shard(0, 4, partition=IID, seed=0)
    stream = Batches(shard, 32, seed=0)
    seen = [next(stream)[1] for _ in range(len(shard) // 32)]
    assert all(len(targets) == 32 for targets in seen)


def test_unknown_task() -> None:
    with pytest.raises(ValueError, match="unknown task 'mnist'; choose one of digits"):
        load_task("mnist")


def test_batches_resume_exactly_where_they_were() -> None:
    shard = load_task("digits").shard(0, 4, partition=IID, seed=0)
    stream = Batches(shard, 32, seed=3)
    for _ in range(17):  # into the second pass over the shard
        next(stream)
    resumed = Batches(shard, 32, seed=3, resume=stream.position())
    for _ in range(20):
        assert torch.equal(next(stream)[1], next(resumed)[1])


def test_a_fresh_stream_that_skips_what_was_drawn_goes_on_in_the_same_order() -> None:
    """How a machine's other ranks resume (they keep no sampler state, only rank 0's count)."""
    shard = load_task("digits").shard(0, 4, partition=IID, seed=0)
    stream = Batches(shard, 32, seed=3)
    drawn = [next(stream)[0] for _ in range(30)]  # into the third pass (11 batches a pass)
    for count in (0, 5, 14, 29):
        skipped = Batches(shard, 32, seed=3)
        skipped.skip(count)
        assert skipped.drawn == 0
        assert torch.equal(next(skipped)[0], drawn[count]), count
    assert stream.drawn == 30

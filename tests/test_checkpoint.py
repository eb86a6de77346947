"""Checkpoints: atomic, pickle-free, readable after a kill at any moment; a node resumes from one."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_until
from safetensors.numpy import load_file, save_file

from gossipmesh.daemon.checkpoint import KEEP, SET_ASIDE, load_newest, save_checkpoint
from node import main

SIZE = 1 << 20


def test_round_trip_keeps_the_newest_and_skips_a_damaged_one(tmp_path: Path) -> None:
    for steps in (10, 20, 30):
        save_checkpoint(tmp_path, steps, {"params": np.full(5, steps, np.float32)}, {"round": steps + 1})
    assert (
        sorted(p.name for p in tmp_path.iterdir())
        == [
            "checkpoint-000000000020.safetensors",
            "checkpoint-000000000030.safetensors",
        ][-KEEP:]
    )
    newest = load_newest(tmp_path)
    assert newest is not None and newest.counters["steps"] == 30 and newest.counters["round"] == 31
    np.testing.assert_array_equal(newest.tensors["params"], np.full(5, 30, np.float32))
    newest.path.write_bytes(newest.path.read_bytes()[:40])  # a damaged file is passed over
    older = load_newest(tmp_path)
    assert older is not None and older.counters["steps"] == 20
    assert load_newest(tmp_path / "nothing-here") is None


@pytest.mark.usefixtures("no_other_threads")
def test_a_kill_at_any_moment_leaves_a_checkpoint_that_loads(tmp_path: Path) -> None:
    writers = multiprocessing.get_context("fork")  # spawning imports torch again: 4 s a writer
    rng = random.Random(7)
    for _ in range(12):
        child = writers.Process(target=_write_forever, args=(tmp_path,))
        child.start()
        assert wait_until(_writes_from(_newest_path(tmp_path), tmp_path))  # it writes...
        time.sleep(rng.random() * 0.3)  # ...and is killed at some moment of it
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        checkpoint = load_newest(tmp_path)
        assert checkpoint is not None
        steps = checkpoint.counters["steps"]
        np.testing.assert_array_equal(checkpoint.tensors["params"], np.full(SIZE, steps, np.float32))
        for path in tmp_path.iterdir():  # every file there is a whole checkpoint or a leftover temp
            assert path.name.startswith(".") or load_file(path)["params"].size == SIZE


@pytest.mark.mesh
def test_a_node_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    state = tmp_path / "state"
    common = ["node", "--insecure", "--listen", "tcp://127.0.0.1:0", "--state-dir", str(state),
              "--checkpoint-every", "25", "--progress", "none"]  # fmt: skip
    assert main([*common, "--steps", "60", "--report", str(tmp_path / "first.json")]) == 0
    first = load_newest(state)
    assert first is not None and first.counters["steps"] == 60  # written on the way out
    assert {"params", "optimizer.momentum_buffer", "rng.torch", "sampler.pass_start"} <= set(first.tensors)
    assert main([*common, "--steps", "100", "--report", str(tmp_path / "second.json")]) == 0
    (node,) = json.loads((tmp_path / "second.json").read_text())["nodes"]
    assert node["resumed_from"] == str(first.path)
    assert node["steps"] == 100 and node["final"]["accuracy"] > 0.85
    assert node["timeline"][0]["accuracy"] > 0.8  # it went on from the trained model, not from scratch


@pytest.mark.mesh
def test_checkpoints_that_do_not_fit_are_moved_aside_and_the_newest_that_fits_is_resumed(
    tmp_path: Path,
) -> None:
    """Issue 29, item 10: newer checkpoints that read but do not fit (another model's shape,
    infinite steps, no RNG state) once failed every start; now each is moved aside and the node
    resumes from the older valid one. Checkpoints and live copies are its owner's alone (0600)."""
    state = tmp_path / "state"
    common = ["node", "--insecure", "--listen", "tcp://127.0.0.1:0", "--state-dir", str(state),
              "--checkpoint-every", "10", "--progress", "none"]  # fmt: skip
    assert main([*common, "--steps", "30"]) == 0
    valid = load_newest(state)
    assert valid is not None and valid.counters["steps"] == 30
    tensors, counters = dict(valid.tensors), dict(valid.counters)
    unfit = {
        40: ({**tensors, "params": tensors["params"][:-2]}, counters),
        50: (tensors, {**counters, "steps": math.inf}),
        60: ({k: v for k, v in tensors.items() if k != "rng.torch"}, counters),
    }
    for steps, (forged, saved) in unfit.items():
        save_file(
            forged, state / f"checkpoint-{steps:012d}.safetensors", metadata={"gossipmesh": json.dumps(saved)}
        )
    live = tmp_path / "live.npy"
    report = tmp_path / "second.json"
    assert main([*common, "--steps", "40", "--live-params", str(live), "--report", str(report)]) == 0
    (record,) = json.loads(report.read_text())["nodes"]
    assert record["resumed_from"] == str(valid.path) and record["steps"] == 40
    assert sorted(p.name for p in state.glob(f"*{SET_ASIDE}")) == [
        f"checkpoint-{steps:012d}.safetensors{SET_ASIDE}" for steps in unfit
    ]
    for written in [*state.glob("checkpoint-*.safetensors"), live]:
        assert written.stat().st_mode & 0o777 == 0o600, written


def _write_forever(folder: Path) -> None:
    """Each checkpoint is a 4 MB tensor filled with its step; steps go on from the newest."""
    newest = load_newest(folder)
    steps = int(newest.counters["steps"]) if newest else 0
    while True:
        steps += 1
        save_checkpoint(folder, steps, {"params": np.full(SIZE, steps, np.float32)}, {})


def _newest_path(folder: Path) -> Path | None:
    checkpoint = load_newest(folder)
    return checkpoint.path if checkpoint else None


def _writes_from(before: Path | None, folder: Path) -> Callable[[], bool]:
    return lambda: _newest_path(folder) != before

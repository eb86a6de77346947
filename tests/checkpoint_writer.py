"""A process that writes ever newer checkpoints until it is killed (imports no torch, so it starts
fast under multiprocessing's spawn)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gossipmesh.daemon.checkpoint import load_newest, save_checkpoint

SIZE = 1 << 20


def write_forever(folder: str) -> None:
    """Each checkpoint is a 4 MB tensor filled with its step; steps go on from the newest."""
    newest = load_newest(Path(folder))
    steps = int(newest.counters["steps"]) if newest else 0
    while True:
        steps += 1
        save_checkpoint(Path(folder), steps, {"params": np.full(SIZE, steps, np.float32)}, {})

"""Crash-safe checkpoints: one safetensors file per checkpoint, written atomically.

A checkpoint is ``STATE_DIR/checkpoint-STEPS.safetensors``: the tensors (flat parameters,
optimizer buffers, RNG and sampler states) in safetensors' format, and the counters as JSON in
its metadata; nothing is pickled. It is written to a temporary file, fsynced, renamed over its
final name and the folder fsynced, so a kill at any moment leaves either no new file or a
complete one. Files are readable by their owner only (0600). A checkpoint that does not read
back whole (a disk fault, a file copied in by hand), or that the node cannot take (another
model's, impossible counters, a part missing: :func:`restore_newest`), is moved aside as
``NAME.bad`` and the next older one tried, so one bad file never stops a node from starting.
The newest ``KEEP`` checkpoints are kept, and temporary files that no writer has touched for
``STALE_TMP_S`` (of killed writers) removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from gossipmesh.report import open_private

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
KEEP = 2
STALE_TMP_S = 600.0  # a writer finishes in seconds: a temporary file this old is a killed one's
_NAME = re.compile(r"checkpoint-(\d+)\.safetensors\Z")
_META_KEY = "gossipmesh"
SET_ASIDE = ".bad"  # the suffix of a checkpoint moved aside
# what reading or taking a checkpoint raises when the file, not the disk, is at fault
UNFIT = (ValueError, KeyError, TypeError, OverflowError, RuntimeError, SafetensorError)


@dataclass(frozen=True)
class Checkpoint:
    tensors: Mapping[str, np.ndarray]
    counters: Mapping[str, Any]  # JSON values: steps, round, sampler position...
    path: Path


def save_checkpoint(
    folder: Path, steps: int, tensors: Mapping[str, np.ndarray], counters: Mapping[str, Any]
) -> Path:
    """Write the checkpoint of ``steps`` atomically; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"checkpoint-{steps:012d}.safetensors"
    metadata = {_META_KEY: json.dumps({"version": FORMAT_VERSION, "steps": steps, **counters})}
    data = save({name: np.ascontiguousarray(array) for name, array in tensors.items()}, metadata=metadata)
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open_private(tmp) as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_folder(folder)
    for old in [*_checkpoints(folder)[KEEP:], *_stale_temporaries(folder)]:
        old.unlink(missing_ok=True)
    return path


def _stale_temporaries(folder: Path) -> list[Path]:
    """Temporary files of killed writers (not those another writer is writing now)."""
    stale = []
    for path in folder.glob(".checkpoint-*.tmp"):
        try:
            if time.time() - path.stat().st_mtime > STALE_TMP_S:
                stale.append(path)
        except OSError:  # gone meanwhile
            continue
    return stale


def load_newest(folder: Path, skip: Collection[Path] = (), at_most: int | None = None) -> Checkpoint | None:
    """The newest checkpoint in ``folder`` (but those in ``skip``, and those of more than
    ``at_most`` steps) that reads back whole, or None; one that does not is moved aside (one
    the disk fails to read is only skipped: the fault may pass)."""
    for path in _checkpoints(folder):
        if path in skip or (at_most is not None and checkpoint_steps(path) > at_most):
            continue
        try:
            return _load(path)
        except OSError as exc:
            log.warning("skipping checkpoint %s, which cannot be read now: %s", path, exc)
        except UNFIT as exc:
            set_aside(path, exc)
    return None


def restore_newest(
    folder: Path, newest: Checkpoint | None, restore: Callable[[Checkpoint], None]
) -> Checkpoint | None:
    """Take ``newest`` (of :func:`load_newest`) with ``restore``, or, where it raises (the
    checkpoint does not fit), move it aside and take the next newest; returns the checkpoint
    taken (None: none fits). ``restore`` checks a checkpoint before it changes anything."""
    tried: set[Path] = set()
    checkpoint = newest
    while checkpoint is not None:
        tried.add(checkpoint.path)
        try:
            restore(checkpoint)
        except UNFIT as exc:
            set_aside(checkpoint.path, exc)
            checkpoint = load_newest(folder, skip=tried)
        else:
            return checkpoint
    return None


def set_aside(path: Path, reason: BaseException) -> None:
    """Rename the checkpoint ``path`` to ``NAME.bad`` (kept for a look, never loaded again)."""
    aside = path.with_name(path.name + SET_ASIDE)
    try:
        os.replace(path, aside)
    except OSError as exc:  # (a read-only folder: the caller skips it all the same)
        log.warning("checkpoint %s cannot be used (%s) nor moved aside: %s", path, reason, exc)
    else:
        log.warning("checkpoint %s cannot be used (%s): moved aside to %s", path, reason, aside.name)


def _load(path: Path) -> Checkpoint:
    with safe_open(str(path), framework="numpy") as reader:
        metadata = reader.metadata() or {}
        counters = json.loads(metadata[_META_KEY])
        tensors = {name: reader.get_tensor(name) for name in reader.keys()}  # noqa: SIM118 - not a dict
    if not isinstance(counters, dict) or counters.get("version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint format {counters.get('version')!r}, this node reads {FORMAT_VERSION}")
    return Checkpoint(tensors, counters, path)


def _checkpoints(folder: Path) -> list[Path]:
    """Checkpoint files in ``folder``, newest (most steps) first."""
    if not folder.is_dir():
        return []
    found = [(checkpoint_steps(p), p) for p in folder.iterdir() if _NAME.match(p.name)]
    return [p for _, p in sorted(found, reverse=True)]


def checkpoint_due(before: int, after: int, every: int) -> bool:
    """Whether a step count that went from ``before`` to ``after`` passed a multiple of
    ``every`` (a straggler catching up with the mesh moves on by several steps at once)."""
    return after // every > before // every


def checkpoint_steps(path: Path) -> int:
    """The steps in a checkpoint file's name."""
    match = _NAME.match(path.name)
    assert match is not None
    return int(match[1])


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable (a crash of the machine, not only of the process)."""
    fd = os.open(folder, os.O_RDONLY)
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)

"""A training node's state as a source serves it (a ``gossip.state.manifest.StateView``): read a chunk at
a time from the live model and optimizer, never copied whole.

Only finding the tensors takes the training lock (an optimizer creates its buffers at its first
step); the copies do not, so serving never waits for a training step, nor a step for serving.
A chunk read while a step writes holds, for each value, the value before or after the step
(an aligned 2, 4 or 8-byte store is atomic): the stream is not one instant's state anyway
(see ``gossip.state.manifest``).

The arrays are ``params`` (the mixing vector: float32, float64 for a float64 model),
``optimizer.KEY`` for each per-parameter buffer of the wrapped optimizer (momentum, Adam's
moments), in parameter order, widened the same way (a parameter without the buffer yet reads as
zeros), and ``scalar.KEY`` for each of its one-value entries (Adam's step count), one float64
a parameter. A model on a GPU is copied to the host a chunk at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from functools import partial

import numpy as np
import torch

from gossip.buffers.flat import FlatParameters, numpy_dtype
from gossip.buffers.shards import local_tensor
from gossip.state.manifest import (
    BUFFER_PREFIX,
    SCALAR_PREFIX,
    Counters,
    Entry,
    Reader,
    Snapshot,
    read_stream,
    split,
)


class LiveState:
    """Args:
    flat: the model's flat parameters.
    params: the optimizer's parameters, in order.
    optimizer: the wrapped optimizer (its ``state`` holds the buffers).
    lock: held while training writes the parameters and buffers.
    counters: the node's counters now.
    background: whether mixing runs beside training (then the host vector is the newest).
    """

    def __init__(
        self,
        flat: FlatParameters,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        lock: AbstractContextManager[object],
        counters: Callable[[], Counters],
        *,
        background: bool,
    ) -> None:
        self._flat, self._params, self._optimizer = flat, list(params), optimizer
        self._lock, self._counters, self._background = lock, counters, background
        self._dtype = flat.wide_dtype
        self._found: Found | None = None  # at the last manifest

    def manifest(self) -> tuple[list[Entry], Counters]:
        """The layout and counters now; reads follow this layout until the next manifest (an
        optimizer that made new buffers since, by a first step or ``load_state_dict``, is read
        as it was found here)."""
        with self._lock:
            self._found = arrays = self._arrays()
            counters = self._counters()
        return _entries(arrays), counters

    def read(self, start: int, stop: int) -> np.ndarray:
        if self._found is None:
            self.manifest()
        assert self._found is not None
        return read_stream(_readers(self._found), start, stop)

    def snapshot(self) -> Snapshot:
        """The whole state at one instant (under the training lock): a checkpoint's."""
        with self._lock:
            arrays = self._arrays()
            entries = _entries(arrays)
            raw = read_stream(_readers(arrays), 0, sum(entry.span for entry in entries))
            counters = self._counters()
        return Snapshot(split(entries, raw), counters)

    def _arrays(self) -> Found:
        """(name, dtype, the tensors that make it up one after the other), under the lock."""
        if not self._background:
            self._flat.wait_for_upload()  # (the buckets are read on the device's compute stream)
        flat = self._flat  # (the model's values: its parameters, then its averaged buffers)
        params = [flat.model_vector] if self._background else flat.model_segments
        arrays = [("params", self._dtype, params)]
        pairs = [(p, self._optimizer.state.get(p, {})) for p in self._params]
        buffers = {k for p, state in pairs for k, v in state.items() if _like(v, p)}
        for key in sorted(buffers):  # (of a sharded model: this rank's shards)
            parts = [local_tensor(state[key] if key in state else torch.zeros_like(p)) for p, state in pairs]
            arrays.append((f"{BUFFER_PREFIX}{key}", self._dtype, parts))
        scalars = {
            k for _, state in pairs for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 0
        }
        for key in sorted(scalars):
            parts = [state[key].reshape(1) if key in state else _ZERO for _, state in pairs]
            arrays.append((f"{SCALAR_PREFIX}{key}", torch.float64, parts))
        return arrays


Found = list[tuple[str, torch.dtype, list[torch.Tensor]]]  # name, dtype, the tensors it is made of


def _entries(arrays: Found) -> list[Entry]:
    return [
        Entry(name, numpy_dtype(dtype), (sum(s.numel() for s in parts),)) for name, dtype, parts in arrays
    ]


def _readers(arrays: Found) -> list[tuple[int, Reader]]:
    return [
        (numpy_dtype(dtype).itemsize * sum(s.numel() for s in parts), partial(_read_bytes, parts, dtype))
        for _, dtype, parts in arrays
    ]


def _read_bytes(segments: Sequence[torch.Tensor], dtype: torch.dtype, start: int, stop: int) -> np.ndarray:
    """Bytes ``start:stop`` of ``segments`` one after the other in ``dtype``, as a new array."""
    itemsize = numpy_dtype(dtype).itemsize
    first, last = start // itemsize, -(-stop // itemsize)
    pieces, offset = [], 0
    for segment in segments:
        count = segment.numel()
        lo, hi = max(first - offset, 0), min(last - offset, count)
        if lo < hi:
            pieces.append(segment.detach().reshape(-1)[lo:hi].to("cpu", dtype))
        offset += count
    raw = torch.cat(pieces).numpy().view(np.uint8)
    skip = start - first * itemsize
    return raw[skip : skip + stop - start]


_ZERO = torch.zeros(1, dtype=torch.float64)


def _like(value: object, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == param.shape


class StateWriter:
    """A joiner's side of :class:`LiveState`: a state written straight into the model's host
    copy and the optimizer's buffers as its chunks arrive (a ``gossip.state.manifest.StateSink``),
    so no copy of the state is ever held. A buffer the state has that this optimizer has not
    made yet (before its first step) is made first, zeros; the one-value entries (a float64 a
    parameter) are kept for the optimizer to load as it keeps them (:attr:`scalars`).

    Args are :class:`LiveState`'s, plus ``entries``: the state's layout, checked to fit."""

    def __init__(
        self,
        flat: FlatParameters,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        lock: AbstractContextManager[object],
        entries: Sequence[Entry],
    ) -> None:
        self._flat, self._lock = flat, lock
        self._buffers: dict[str, list[torch.Tensor]] = {}
        self.scalars = {
            e.name: np.zeros(e.shape, e.dtype) for e in entries if e.name.startswith(SCALAR_PREFIX)
        }
        with lock:
            flat.copy_to_host()  # (waits for an upload still reading the host copy)
            for entry in entries:
                if entry.name.startswith(BUFFER_PREFIX):
                    key = entry.name.removeprefix(BUFFER_PREFIX)
                    states = [optimizer.state[p] for p in params]
                    for param, state in zip(params, states, strict=True):
                        if not _like(state.get(key), param):
                            state[key] = torch.zeros_like(param)
                    self._buffers[entry.name] = [local_tensor(state[key]) for state in states]

    def write(self, entry: Entry, first: int, values: np.ndarray) -> None:
        if entry.name in self.scalars:
            self.scalars[entry.name][first : first + values.size] = values
            return
        with self._lock:
            if entry.name == "params":
                self._flat.model_array[first : first + values.size] = values
            else:
                _write_elements(self._buffers[entry.name], first, values)

    def tensors(self) -> dict[str, np.ndarray]:
        return {}


def _write_elements(segments: Sequence[torch.Tensor], first: int, values: np.ndarray) -> None:
    """Elements ``first...`` of ``segments`` one after the other: ``values``, converted to each
    segment's dtype and device."""
    offset = 0
    for segment in segments:
        count = segment.numel()
        lo, hi = max(first - offset, 0), min(first + values.size - offset, count)
        if lo < hi:
            part = torch.from_numpy(values[offset + lo - first : offset + hi - first].copy())
            segment.detach().view(-1)[lo:hi].copy_(part)
        offset += count

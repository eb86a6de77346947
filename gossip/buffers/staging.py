"""Copies between a model's device buckets and its host vector, chunk by chunk on a side stream,
so that the upload of the mixed parameters overlaps the next forward pass.

After a gossip round the host vector holds the mixed parameters. The upload is queued chunk by
chunk on a copy stream and the host goes on at once; each chunk records an event. The compute
stream waits (on the device: the host never blocks) for a chunk only where it is first needed.
The model is seen as its blocks (the items of its largest ``nn.ModuleList`` or ``nn.Sequential``:
a transformer's layers, an MLP's) and the rest (embeddings, a head): the rest is uploaded first
and waited for in the model's forward pre-hook, then each block's chunks, each waited for in the
block's own pre-hook, so the first blocks compute while the last are still uploading. This holds
while each block reads only parameters inside it (a fused attention reading its projections'
weights does) and nothing outside a block reads a block's parameters without calling it.
Whatever no forward pass waited for is waited for before the next optimizer step. The host
vector is not written again before the uploads have read it: the next download drains the copy
stream first. A chunk of a bucket narrower than the vector
(bfloat16, float16) is widened or rounded on the device through one chunk-sized buffer, so
staging needs at most one chunk of device memory beyond the model.

On the CPU the same chunks are copied at once (:class:`ImmediateCopies`); the tests drive the
chunk-and-wait logic with a copy stream that runs a chunk only when it is waited on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

STAGE_CHUNK = 1 << 22  # elements per staged copy (16 MiB of float32)


class CopyStream(Protocol):
    """Where staged copies run, one chunk at a time."""

    def begin(self) -> None:
        """Copies queued from now on come after the work already queued on the compute stream."""

    def run(self, index: int, copy: Callable[[], None]) -> None:
        """Queue the copy of chunk ``index`` (after the copies queued before it)."""

    def wait(self, index: int) -> None:
        """Work queued on the compute stream from now on comes after chunk ``index``'s last copy."""

    def drain(self) -> None:
        """Return once every queued copy is done (the host may then write the host vector)."""


class ImmediateCopies:
    """Copies done when queued: the staged path of a model in host memory."""

    def begin(self) -> None:
        pass

    def run(self, index: int, copy: Callable[[], None]) -> None:
        copy()

    def wait(self, index: int) -> None:
        pass

    def drain(self) -> None:
        pass


class CudaCopyStream:
    """Copies on a side CUDA stream, an event recorded after each chunk's."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device)
        self._device = device
        self._events: dict[int, torch.cuda.Event] = {}

    def begin(self) -> None:
        self._stream.wait_stream(torch.cuda.current_stream(self._device))

    def run(self, index: int, copy: Callable[[], None]) -> None:
        with torch.cuda.stream(self._stream):
            copy()
            event = self._events.get(index) or torch.cuda.Event()
            event.record(self._stream)
            self._events[index] = event

    def wait(self, index: int) -> None:
        event = self._events.get(index)
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def drain(self) -> None:
        self._stream.synchronize()


@dataclass(frozen=True)
class Chunk:
    """A stretch of one bucket and the same stretch of the host vector."""

    host: torch.Tensor
    device: torch.Tensor


def plan_chunks(host: torch.Tensor, buckets: list[torch.Tensor], size: int = STAGE_CHUNK) -> list[Chunk]:
    """The host vector and the buckets (laid one after the other in it) cut into stretches of
    at most ``size`` elements, none crossing a bucket's end."""
    chunks, offset = [], 0
    for bucket in buckets:
        for start in range(0, bucket.numel(), size):
            stop = min(start + size, bucket.numel())
            chunks.append(Chunk(host[offset + start : offset + stop], bucket[start:stop]))
        offset += bucket.numel()
    return chunks


class Stager:
    """The staged copies of one model (see the module's docstring). ``buffer``: a device
    tensor of the host vector's dtype and one chunk's size, through which narrower buckets
    are cast on the device (None on the CPU, where ``copy_`` casts as it copies)."""

    def __init__(self, chunks: list[Chunk], copies: CopyStream, buffer: torch.Tensor | None) -> None:
        self.chunks = chunks
        self.copies = copies
        self._buffer = buffer
        self._unwaited: set[int] = set()  # uploaded chunks the compute stream has not waited for
        self.upload_order = list(range(len(chunks)))

    def upload_first(self, groups: Sequence[Iterable[int]]) -> None:
        """Upload these groups of chunks first, in this order (then the others)."""
        order = dict.fromkeys(index for group in groups for index in sorted(group))
        self.upload_order = [*order, *(i for i in range(len(self.chunks)) if i not in order)]

    def download(self) -> None:
        """The host vector := the buckets (the host waits for it)."""
        self.copies.drain()  # (the uploads have read the host vector)
        self.copies.begin()
        for index, chunk in enumerate(self.chunks):
            self.copies.run(index, partial(self._copy, chunk.device, chunk.host))
        self.copies.drain()

    def upload(self) -> None:
        """Queue the buckets := the host vector, each value rounded once to its bucket's dtype;
        returns before the copies are done (:meth:`wait_for`, :meth:`wait_all`)."""
        self.copies.begin()  # (after the compute stream's last use of the old parameters)
        for index in self.upload_order:
            chunk = self.chunks[index]
            self.copies.run(index, partial(self._copy, chunk.host, chunk.device))
        self._unwaited = set(range(len(self.chunks)))

    def wait_for(self, indices: frozenset[int]) -> None:
        """The compute stream waits for these chunks' uploads (those not waited for yet)."""
        for index in indices & self._unwaited:
            self.copies.wait(index)
            self._unwaited.discard(index)

    def wait_all(self) -> None:
        self.wait_for(frozenset(self._unwaited))

    def _copy(self, source: torch.Tensor, target: torch.Tensor) -> None:
        if self._buffer is None or source.dtype == target.dtype:
            target.copy_(source, non_blocking=True)
            return
        # one side is a narrower bucket on the device: cast there, through the buffer
        buffer = self._buffer[: source.numel()]
        if source.is_cuda:  # download: widen on the device, then copy to the host
            buffer.copy_(source)
            target.copy_(buffer, non_blocking=True)
        else:  # upload: copy to the device, then round on it
            buffer.copy_(source, non_blocking=True)
            target.copy_(buffer)


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The items with parameters of the model's largest ``nn.ModuleList`` or ``nn.Sequential``
    (by parameters; the model itself counts): its layers. None found: no blocks."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList | torch.nn.Sequential)]
    if not lists:
        return []
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return [item for item in largest if any(True for _ in item.parameters())]

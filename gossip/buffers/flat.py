"""One flat buffer per model and dtype: a message is one contiguous frame per dtype, mixing is
one vector op.

The parameters move into one contiguous tensor per dtype (a bucket); each parameter becomes a
view of its bucket. The averaging algorithms work on one host numpy vector (:attr:`array`) of
float32 (float64 when the model has float64 parameters): for a float32 model on the CPU it is
the model's own memory; otherwise (a bfloat16, float16 or mixed-dtype model, a model on a GPU)
it is a host copy, pinned for a GPU, which the training loop refreshes before the parameters
are mixed (:meth:`copy_to_host`, exact: every narrower float widens exactly) and writes back
after (:meth:`copy_to_device`, rounding each value once to its parameter's dtype; on a GPU the
upload can overlap the next forward pass: ``gossip.buffers.staging``). The wire
carries model values bucket by bucket in the model's dtypes (:attr:`layout`), so nodes on
different devices, or mixing dtypes, gossip with each other unchanged.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from gossip.buffers.staging import (
    STAGE_CHUNK,
    CopyStream,
    CudaCopyStream,
    ImmediateCopies,
    Stager,
    plan_chunks,
    repeated_blocks,
)
from gossip.buffers.vector import Layout, dtype_named

#: the name of the numpy dtype of each torch dtype a model may train in
FLOAT_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array (bfloat16 as ml_dtypes' bfloat16), no copy."""
    if tensor.dtype == torch.bfloat16:
        return tensor.detach().view(torch.int16).numpy().view(numpy_dtype(torch.bfloat16))
    return tensor.detach().numpy()


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype that holds the values of a model's ``dtype`` (one of FLOAT_DTYPES)."""
    return dtype_named(FLOAT_DTYPES[dtype])


class FlatParameters:
    """Moves parameters into one contiguous tensor per dtype and makes each parameter a view of
    it. Parameter objects keep their identity, so an optimizer built before or after flattening
    keeps working. Unless :attr:`staged`, writing into :attr:`array` changes the model in place.

    Args:
        params: the parameters, on one device, of float dtypes (a bucket per dtype, in the order
            the dtypes first appear: the same on every node with the same model).
        buffers: the model's floating-point buffers (BatchNorm's running statistics), mixed with
            the parameters and part of the model's values (:attr:`model_array`).
        extras: tensors mixed along with the parameters (an optimizer's momentum buffers).

        Each becomes a view of the vector, in that order: its first :attr:`param_size` elements
        are the parameters, its first :attr:`model_size` the parameters and buffers (one bucket
        holds all when they are of one dtype, else each group has a bucket per dtype after the
        previous group's).
        staged: keep a separate host copy for :attr:`array`; None: when the vector cannot be
            the model's memory (a GPU model, a dtype other than the vector's, several dtypes).
            True on a CPU float32 model runs the staged path, as the tests do. False: the vector
            is the model's memory in the model's dtype (a CPU model of one dtype, else
            ValueError): a bfloat16 or float16 model then has no float32 copy (2x its bytes),
            and mixing rounds each neighbour's value into it as it mixes it in, where the
            float32 copy rounds once per round.
        chunk: elements per staged copy (see ``gossip.buffers.staging``).
        copies: where staged copies run; None: a side stream on a GPU, at once on the CPU.
        tail: elements allocated after each bucket, outside the vector: room for a reader of a
            tensor's memory that reads past its end (FSDP2's padded shards, ``gossip.buffers.shards``).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        buffers: Iterable[torch.Tensor] = (),
        extras: Iterable[torch.Tensor] = (),
        staged: bool | None = None,
        chunk: int = STAGE_CHUNK,
        copies: CopyStream | None = None,
        tail: int = 0,
    ) -> None:
        unique = list({id(p): p for p in params}.values())
        if not unique:
            raise ValueError("no parameters to flatten")
        seen = {id(p) for p in unique}
        held = [t for key, t in {id(t): t for t in buffers}.items() if key not in seen]
        seen |= {id(t) for t in held}
        extra = [t for key, t in {id(t): t for t in extras}.items() if key not in seen]
        everything = unique + held + extra
        devices = {p.device for p in everything}
        if len(devices) != 1:
            raise ValueError(
                f"parameters must share one device, got {devices}; move the whole model with "
                "model.to(device) first"
            )
        unknown = {p.dtype for p in everything} - FLOAT_DTYPES.keys()
        if unknown:
            raise ValueError(
                f"gossip averages float parameters ({', '.join(map(str, FLOAT_DTYPES))}), not {unknown}"
            )
        device = unique[0].device
        dtypes = {t.dtype for t in everything}
        groups = (
            [everything] if len(dtypes) == 1 else [*_by_dtype(unique), *_by_dtype(held), *_by_dtype(extra)]
        )
        self._spans: dict[int, tuple[int, int]] = {}  # id(parameter) -> its stretch of the vector
        self.buckets: list[torch.Tensor] = []
        for group in groups:
            self.buckets.append(
                _bucket(group, device, self._spans, base=sum(b.numel() for b in self.buckets), tail=tail)
            )
        self.param_size = sum(p.numel() for p in unique)
        self.model_size = self.param_size + sum(t.numel() for t in held)
        self.layout = Layout(tuple((numpy_dtype(b.dtype), b.numel()) for b in self.buckets))
        # what values widen to exactly (a state snapshot's dtype); the vector's, unless in place
        self.wide_dtype = torch.float64 if torch.float64 in dtypes else torch.float32
        self.vector_dtype = self.wide_dtype
        one_cpu_bucket = len(self.buckets) == 1 and device.type == "cpu"
        if staged is False:
            if not one_cpu_bucket:
                raise ValueError(
                    "mixing in the model's own memory (staged=False, --mix-in-place) needs a CPU "
                    f"model of one dtype, not {'several dtypes' if len(self.buckets) > 1 else device}"
                )
            self.vector_dtype = self.buckets[0].dtype
        in_place = one_cpu_bucket and self.buckets[0].dtype == self.vector_dtype
        self.staged = not in_place if staged is None else staged or not in_place
        total = sum(b.numel() for b in self.buckets)
        on_gpu = device.type == "cuda"
        self._host = (
            torch.empty(total, dtype=self.vector_dtype, pin_memory=on_gpu) if self.staged else self.buckets[0]
        )
        narrow = any(b.dtype != self.vector_dtype for b in self.buckets)
        self.stager = Stager(
            plan_chunks(self._host, self.buckets, chunk),
            copies or (CudaCopyStream(device) if on_gpu else ImmediateCopies()),
            torch.empty(min(chunk, total), dtype=self.vector_dtype, device=device)
            if on_gpu and narrow
            else None,
        )
        self._chunk_starts = list(
            itertools.accumulate((c.host.numel() for c in self.stager.chunks), initial=0)
        )
        self.copy_to_host()

    @property
    def tensor(self) -> torch.Tensor:
        """The one bucket of a model of one dtype (the model's memory, on its device)."""
        if len(self.buckets) != 1:
            raise ValueError("a model of several dtypes has one bucket per dtype: see buckets")
        return self.buckets[0]

    @property
    def array(self) -> np.ndarray:
        """The parameters (and extras) as a host numpy vector: the model's own memory, or its
        host copy (as of the last :meth:`copy_to_host`) when staged."""
        return numpy_view(self._host)

    @property
    def model_vector(self) -> torch.Tensor:
        """The model's values of :attr:`array` as a tensor on the host (a view)."""
        return self._host.detach()[: self.model_size]

    @property
    def param_array(self) -> np.ndarray:
        """The parameters' part of :attr:`array` (a view)."""
        return self.array[: self.param_size]

    @property
    def model_array(self) -> np.ndarray:
        """The model's values (parameters and buffers) of :attr:`array` (a view)."""
        return self.array[: self.model_size]

    @property
    def param_segments(self) -> list[torch.Tensor]:
        """The parameters' part of the buckets, on the device, in the vector's order."""
        return self._segments(self.param_size)

    @property
    def model_segments(self) -> list[torch.Tensor]:
        """The model's values' part of the buckets, on the device, in the vector's order."""
        return self._segments(self.model_size)

    def _segments(self, size: int) -> list[torch.Tensor]:
        segments, left = [], size
        for bucket in self.buckets:
            if left:
                segments.append(bucket[: min(left, bucket.numel())])
                left -= segments[-1].numel()
        return segments

    def copy_to_host(self) -> None:
        """Make :attr:`array` the model's current parameters (no-op unless staged); complete on
        return."""
        if self.staged:
            self.stager.download()

    def copy_to_device(self, *, blocking: bool = True) -> None:
        """Give the model what was written into :attr:`array`, each value rounded once to its
        parameter's dtype (no-op unless staged). ``blocking=False`` only queues the upload:
        :attr:`array` must then not be written before the next :meth:`copy_to_host`, and the
        parameters not be read on the device before :meth:`wait_for_upload` or the forward
        pre-hooks of :meth:`overlap_upload` (the compute stream waits; the host does not)."""
        if not self.staged:
            return
        self.stager.upload()
        if blocking:
            self.stager.copies.drain()
            self.stager.wait_all()

    @property
    def uploads_in_background(self) -> bool:
        """Whether :meth:`copy_to_device` can return before the copies are done (a GPU's)."""
        return self.staged and not isinstance(self.stager.copies, ImmediateCopies)

    def wait_for_upload(self) -> None:
        """Work queued on the device from now on sees the whole upload (the host goes on)."""
        self.stager.wait_all()

    def overlap_upload(
        self, model: torch.nn.Module, blocks: Sequence[torch.nn.Module] | None = None
    ) -> list[RemovableHandle]:
        """Forward pre-hooks that let ``model``'s first blocks compute while the last still
        upload: the model waits for the chunks of its parameters outside the blocks (uploaded
        first), each block for those of its own (see ``gossip.buffers.staging`` for what this asks of
        the model). ``blocks``: None: the items of its largest ModuleList or Sequential."""
        blocks = repeated_blocks(model) if blocks is None else blocks
        inside = {id(p) for block in blocks for p in block.parameters()}
        rest = self._chunks_for(p for p in model.parameters() if id(p) not in inside)
        per_block = [self._chunks_for(block.parameters()) for block in blocks]
        self.stager.upload_first([rest, *per_block])
        return [
            module.register_forward_pre_hook(lambda _m, _a, c=chunks: self.stager.wait_for(c))
            for module, chunks in ((model, rest), *zip(blocks, per_block, strict=True))
            if chunks
        ]

    def _chunks_for(self, params: Iterable[torch.Tensor]) -> frozenset[int]:
        """The chunks holding these (flattened) parameters."""
        return frozenset(
            index for p in params if id(p) in self._spans for index in self._chunks_of(*self._spans[id(p)])
        )

    def _chunks_of(self, start: int, stop: int) -> range:
        """The chunks holding elements ``start:stop`` (not empty) of the vector."""
        starts = self._chunk_starts
        return range(bisect.bisect_right(starts, start) - 1, bisect.bisect_right(starts, stop - 1))


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype, in the order the dtypes first appear."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())


def _bucket(
    params: list[torch.Tensor],
    device: torch.device,
    spans: dict[int, tuple[int, int]],
    *,
    base: int,
    tail: int,
) -> torch.Tensor:
    """One flat tensor holding ``params`` (of one dtype), each made a view of it, in memory of
    ``tail`` zeros more; ``spans`` gets each parameter's stretch of the vector (none for an
    empty one), where the bucket starts at ``base``."""
    size = sum(p.numel() for p in params)
    memory = torch.empty(size + tail, dtype=params[0].dtype, device=device)
    memory[size:].zero_()
    bucket = memory[:size]
    offset = 0
    for param in params:
        view = bucket[offset : offset + param.numel()]
        view.copy_(param.data.reshape(-1))
        param.data = view.view_as(param)
        if param.numel():
            spans[id(param)] = (base + offset, base + offset + param.numel())
        offset += param.numel()
    return bucket


def host_vector_bytes(params: Iterable[torch.Tensor]) -> int:
    """The size of :func:`host_vector` of ``params``, without making it."""
    tensors = list(params)
    itemsize = 8 if any(t.dtype == torch.float64 for t in tensors) else 4
    return itemsize * sum(t.numel() for t in tensors)


def host_vector(params: Iterable[torch.Tensor]) -> np.ndarray:
    """A copy of ``params`` as one host vector of their mixing dtype (float32, or float64)."""
    tensors = [p.detach().reshape(-1) for p in params]
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return torch.cat([t.to(device="cpu", dtype=dtype) for t in tensors]).numpy()

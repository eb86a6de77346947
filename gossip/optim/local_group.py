"""A machine of several local ranks (one process per device) as one member of the mesh.

Inside the machine the ranks keep one replica, as DDP does: at the end of every backward pass
the gradients are averaged over the ranks (``BackwardAveraging``: one allreduce of a flat
buffer; NCCL on CUDA, gloo on the CPU), so what reads them before the step (a GradScaler's
overflow check, gradient clipping) sees the same on every rank, and every rank takes the same
step. Averaging gradients, not parameters every round, keeps the replica exact at every step
and costs one allreduce of the gradients, which the machine's own links carry at 10-100x the
network's speed.

Across machines each rank gossips one slice of the flat parameters (``bounds``) with the same
rank of the neighbouring machines, over its own ZeroMQ transport: the machine sends each byte
of the model once per round, in N parallel streams. After the round every rank broadcasts
its mixed slice to the others (``share_slices``), so all ranks again hold bitwise-equal
parameters. The member view a round is computed on is local rank 0's (it runs membership),
handed to the others before each round (``share_view``), so all slices mix over one graph.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from typing import Protocol

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from gossip.messages import StateManifest
from gossip.state.manifest import Manifest, Snapshot, split

MAX_SHARED_BYTES = 1 << 40


class ViewSource(Protocol):
    """Local rank 0's network: it exports the member view (``p2p.Peer``)."""

    def export_view(self) -> bytes: ...


class ViewSink(Protocol):
    """The network of local rank 1, 2...: it takes rank 0's view (``p2p.LocalRankPeer``)."""

    def import_view(self, data: bytes) -> None: ...


class LocalGroup:
    """This process's place among its machine's local ranks: a ``torch.distributed`` process
    group (the default one, or ``group``) of the ranks of one machine, rank 0 the member.

    Every method is a collective: all ranks call it in the same order (the optimizer does).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise ValueError(
                "a LocalGroup needs torch.distributed: start the ranks with torchrun, or call "
                "torch.distributed.init_process_group first (or use LocalGroup.from_environment())"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.bytes_local = 0  # payload bytes this rank handed to the machine's collectives
        cuda = self._nccl
        self._device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    @classmethod
    def from_environment(cls, backend: str | None = None) -> LocalGroup:
        """The local ranks as ``torchrun`` (or ``gossipmesh node --local-ranks``) started them:
        joins the process group from ``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` /
        ``WORLD_SIZE`` unless one is up already. ``backend``: None: nccl on a CUDA machine, else
        gloo. One machine's ranks only: ``LOCAL_WORLD_SIZE`` must equal ``WORLD_SIZE`` (the
        mesh, not torchrun, joins machines)."""
        local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
        if local is not None and world is not None and local != world:
            raise ValueError(
                f"WORLD_SIZE={world} but LOCAL_WORLD_SIZE={local}: start torchrun on each machine "
                "with --nnodes=1 (--standalone); the gossip mesh joins the machines"
            )
        if not dist.is_initialized():
            default = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend or default)
        return cls()

    @property
    def _nccl(self) -> bool:
        return dist.get_backend(self.group) == "nccl"

    def bounds(self, n: int) -> list[tuple[int, int]]:
        """Each rank's slice ``[lo, hi)`` of a vector of ``n`` elements (nearly equal parts)."""
        cuts = [n * r // self.size for r in range(self.size + 1)]
        return list(itertools.pairwise(cuts))

    def average_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Replace every parameter's gradient by the mean over the local ranks (one allreduce
        per dtype; a parameter with no gradient counts as zero, as on every rank alike)."""
        params = [p for p in params if p.requires_grad]
        for dtype in dict.fromkeys(p.dtype for p in params):
            group = [p for p in params if p.dtype == dtype]
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group]
            )
            self._all_reduce(flat)
            flat /= self.size
            offset = 0
            for p in group:
                part = flat[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = part.clone()
                else:
                    p.grad.copy_(part)
                offset += p.numel()

    def share_slices(self, vector: np.ndarray) -> None:
        """Every rank's slice of ``vector`` (a host array) from that rank to all the others."""
        tensor = torch.from_numpy(vector)
        for r, (lo, hi) in enumerate(self.bounds(vector.size)):
            self._broadcast(tensor[lo:hi], src=r)

    def share_int(self, value: int | None) -> int:
        """Rank 0's ``value`` on every rank (the others pass None)."""
        shared = torch.tensor([value if value is not None else 0], dtype=torch.int64)
        self._broadcast(shared, src=0)
        return int(shared.item())

    def share_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass None)."""
        size = self.share_int(len(data) if data is not None else None)
        if not 0 <= size <= MAX_SHARED_BYTES:
            raise ValueError(f"rank 0 shares {size} bytes: more than {MAX_SHARED_BYTES}")
        if self.rank == 0 and data:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(size, dtype=torch.uint8)
        self._broadcast(buffer, src=0)
        return buffer.numpy().tobytes()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank."""
        sizes = torch.zeros(self.size, dtype=torch.int64)
        sizes[self.rank] = len(data)
        self._all_reduce(sizes)
        padded = torch.zeros((self.size, int(sizes.max().item())), dtype=torch.uint8)
        if data:
            padded[self.rank, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._all_reduce(padded)  # (each row is zero but on its own rank: the sum gathers)
        return [padded[r, : int(n)].numpy().tobytes() for r, n in enumerate(sizes.tolist())]

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (all ranks stop at the same step)."""
        value = torch.tensor([int(flag)], dtype=torch.int32)
        self._all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def share_view(self, network: object) -> None:
        """Rank 0's member view on every rank's network (before a round: all slices mix over
        the graph of one view)."""
        if self.rank == 0:
            source: ViewSource = network  # type: ignore[assignment]
            self.share_bytes(source.export_view())
        else:
            sink: ViewSink = network  # type: ignore[assignment]
            sink.import_view(self.share_bytes(None))

    def share_snapshot(self, snapshot: Snapshot | None) -> Snapshot:
        """Rank 0's training state (``snapshot``; the others pass None) on every rank."""
        if self.rank == 0:
            assert snapshot is not None
            entries, counters = snapshot.manifest()
            message = Manifest.message(entries, counters, transfer=0)
            self.share_bytes(msgpack.packb(message.encode()))
            raw = snapshot.read(0, message.total)
            self.share_bytes(raw.tobytes())
            return snapshot
        shared = StateManifest.decode(msgpack.unpackb(self.share_bytes(None)))
        manifest = Manifest.parse(shared, MAX_SHARED_BYTES)
        raw = np.frombuffer(bytearray(self.share_bytes(None)), dtype=np.uint8)
        if raw.size != manifest.total:
            raise ValueError(f"rank 0 shared {raw.size} bytes of state, its manifest says {manifest.total}")
        return Snapshot(split(manifest.entries, raw), manifest.counters)

    def check_network(self, network: object) -> None:
        """Raise TypeError unless ``network`` can take part in :meth:`share_view`."""
        needed = "export_view" if self.rank == 0 else "import_view"
        if not callable(getattr(network, needed, None)):
            kind = "p2p.Peer" if self.rank == 0 else "p2p.LocalRankPeer"
            raise TypeError(
                f"local rank {self.rank} gossips through a {kind} (it has {needed}()); got "
                f"{type(network).__name__}"
            )

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """``tensor`` (on the host) from local rank ``src`` to the others, in place."""
        self.bytes_local += tensor.numel() * tensor.element_size()
        if self._device.type == "cpu":
            dist.broadcast(tensor, src=self._global(src), group=self.group)
            return
        moved = tensor.to(self._device)
        dist.broadcast(moved, src=self._global(src), group=self.group)
        tensor.copy_(moved.cpu())

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """``tensor`` (on the host, or already on the group's device) reduced in place."""
        self.bytes_local += tensor.numel() * tensor.element_size()
        if tensor.device == self._device:
            dist.all_reduce(tensor, op=op, group=self.group)
            return
        moved = tensor.to(self._device)
        dist.all_reduce(moved, op=op, group=self.group)
        tensor.copy_(moved.cpu())


class BackwardAveraging:
    """Averages the gradients of ``params`` over the local ranks once at the end of every
    backward pass that reaches them (as DDP does, from the autograd engine's end-of-pass
    callback), so every rank's step, and what looks at the gradients before it, sees the
    same. Gradient accumulation works: each pass averages what has accumulated."""

    def __init__(self, group: LocalGroup, params: Iterable[torch.Tensor]) -> None:
        self._group = group
        self._params = [p for p in params if p.requires_grad]
        self._queued = False
        self._averaged = False  # since the last step
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self._params]

    def before_step(self) -> None:
        """Average now unless a backward pass did since the last step (gradients set by hand)."""
        if not self._averaged:
            self._group.average_gradients(self._params)
        self._averaged = False

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _accumulated(self, _param: torch.Tensor) -> None:
        if not self._queued:  # the first gradient of this pass: average when the pass ends
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average)

    def _average(self) -> None:
        self._queued = False
        self._group.average_gradients(self._params)
        self._averaged = True

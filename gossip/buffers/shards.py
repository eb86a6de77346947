"""A model sharded over a machine's local ranks with torch's FSDP2 (``fully_shard``): each
parameter's local shard as one tensor of the flat buffer, in place.

FSDP2 keeps each parameter as a DTensor whose local tensor is this rank's shard (dim 0), and
all-gathers, before a forward pass, from a 1-D tensor of the *padded* shard size (the shards of
the first ranks are whole rows; a later one may hold fewer rows, or none, and is padded): the
local tensor is the start of it. :class:`Shards` lets ``FlatParameters`` move the local tensors
into its buckets (their ``.data``, as for whole parameters) and then points FSDP's all-gather
input of each parameter at the same memory (:meth:`Shards.bind`), so that what gossip mixes
into the vector is what the next forward pass gathers. A padded shard's all-gather input runs
past its own elements into the next tensor's (or the bucket's ``tail``): FSDP only reads that
padding, and drops what it gathered there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from gossip.buffers.staging import repeated_blocks


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (this rank's shard, the DTensor's own memory); any other tensor
    as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def is_sharded(params: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``params`` is a DTensor (a parameter of a ``fully_shard``-ed model)."""
    return any(isinstance(p, DTensor) for p in params)


@dataclass(frozen=True)
class Shards:
    """The optimizer's parameters of a ``fully_shard``-ed model (see the module docstring).

    Args:
        local: each parameter's local shard, in the optimizer's order (what the flat buffer holds).
        padded: each one's all-gather input (FSDP's padded shard, ``FSDPParam._sharded_param_data``).
        owners: each one's FSDP record, whose all-gather input :meth:`bind` replaces.
    """

    local: list[torch.Tensor]
    padded: list[int]
    owners: list[Any]  # FSDP2's FSDPParam (private to torch: only its all-gather input is touched)

    @classmethod
    def of(cls, model: torch.nn.Module, params: Sequence[torch.Tensor], group_size: int) -> Shards:
        """The shards of ``params`` (all parameters of ``model``, sharded by ``fully_shard`` over
        ``group_size`` ranks: the machine's local ranks). Raises ValueError for a parameter that
        is not, saying what to do."""
        from torch.distributed.fsdp import FSDPModule  # (torch 2.6 on; a plain model needs none)

        records = {
            id(record.sharded_param): record
            for module in model.modules()
            if isinstance(module, FSDPModule)
            for group in _param_groups(module)
            for record in group.fsdp_params
        }
        owners = []
        for param in params:
            record = records.get(id(param))
            if record is None:
                raise ValueError(
                    f"shard=True: a parameter of shape {tuple(param.shape)} is not sharded by "
                    "fully_shard on the model given: call fully_shard(model) (and on its blocks) "
                    "before making the optimizer, and pass that model"
                )
            mesh = record.sharded_param.device_mesh
            if mesh.size() != group_size:
                raise ValueError(
                    f"shard=True: the model is sharded over {mesh.size()} ranks, the machine has "
                    f"{group_size}: call fully_shard(model, mesh=...) on the local group's ranks"
                )
            owners.append(record)
        return cls(
            local=[local_tensor(p) for p in params],
            padded=[int(r._sharded_param_data.numel()) for r in owners],
            owners=owners,
        )

    @property
    def tail(self) -> int:
        """The most elements an all-gather input reads past its own shard (its padding)."""
        return max((padded - t.numel() for t, padded in zip(self.local, self.padded, strict=True)), default=0)

    def bind(self) -> None:
        """Point FSDP's all-gather input of each parameter at its local tensor's memory (after the
        flat buffer moved the local tensors), padding included."""
        for tensor, padded, record in zip(self.local, self.padded, self.owners, strict=True):
            memory = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            memory.set_(tensor.untyped_storage(), tensor.storage_offset(), (padded,), (1,))
            record._sharded_param_data = memory


def _param_groups(module: torch.nn.Module) -> list[Any]:
    """The FSDP parameter group(s) of one ``fully_shard``-ed module (none: no direct parameters)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def shard_model(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, device: str = "cpu"
) -> None:
    """Shard ``model`` over the default process group (a machine's local ranks) with FSDP2:
    each of its blocks (``gossip.buffers.staging.repeated_blocks``: gathered one at a time in a
    forward pass), then the whole. ``optimizer``, made on the model's parameters before (and
    not stepped yet), then holds the sharded ones in their place. A model made on the meta
    device (``with torch.device("meta")``: a model larger than a rank's memory is never whole
    on one) is then made on ``device``, shard by shard, by its modules' ``reset_parameters``
    (a parameter no module resets is left uninitialized: initialize it after)."""
    from torch.distributed.fsdp import fully_shard

    before = dict(model.named_parameters())
    for block in repeated_blocks(model):
        fully_shard(block)
    fully_shard(model)
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        # on the CPU, DTensor's random ops draw each rank's shard from the rank's own generator:
        # seeded per rank, the ranks' rows differ and rank r's are the same on every machine
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch.initial_seed() + torch.distributed.get_rank())
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
    if optimizer is None:
        return
    if optimizer.state:
        raise ValueError("shard the model before the optimizer's first step (its state is the whole model's)")
    after = {id(before[name]): param for name, param in model.named_parameters()}
    for group in optimizer.param_groups:
        group["params"] = [after.get(id(p), p) for p in group["params"]]


def whole_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """``model``'s parameters whole: a sharded one gathered from every rank (a collective)."""
    return [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]


def release(model: torch.nn.Module) -> None:
    """Free what a forward pass alone (an evaluation) left gathered of a sharded model: FSDP2's
    root keeps its parameters whole for the backward pass it expects."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()

"""One flat buffer per model: a message is one contiguous frame, mixing is one vector op.

The averaging algorithms work on a numpy array. For a CPU model that array is the model's own
memory. For a model on another device (a CUDA GPU) it is a host copy, pinned so that copies
run at full PCIe speed: the training loop copies the parameters to the host before they are
mixed and back to the device after (see :class:`~gossip.optimizer.GossipOptimizer`). The wire
carries host bytes either way, so nodes on different devices gossip with each other unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


class FlatParameters:
    """Moves parameters into one contiguous tensor and makes each parameter a view of it.

    Parameter objects keep their identity, so an optimizer built before or after flattening
    keeps working. Unless :attr:`staged`, writing into :attr:`array` changes the model in place.

    Args:
        params: the parameters, all of one dtype and on one device.
        staged: keep a separate host copy for :attr:`array`; None: when the parameters are not
            on the CPU (True on a CPU model runs the staged path, as the tests do).
    """

    def __init__(self, params: Iterable[torch.Tensor], *, staged: bool | None = None) -> None:
        unique = list({id(p): p for p in params}.values())
        if not unique:
            raise ValueError("no parameters to flatten")
        dtypes = {p.dtype for p in unique}
        devices = {p.device for p in unique}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"parameters must share one dtype and device, got {dtypes} on {devices}; "
                "move the whole model with model.to(device) first"
            )
        total = sum(p.numel() for p in unique)
        device = unique[0].device
        self.tensor = torch.empty(total, dtype=unique[0].dtype, device=device)
        offset = 0
        for param in unique:
            n = param.numel()
            view = self.tensor[offset : offset + n]
            view.copy_(param.data.reshape(-1))
            param.data = view.view_as(param)
            offset += n
        self.staged = device.type != "cpu" if staged is None else staged
        self._host = (
            torch.empty(total, dtype=self.tensor.dtype, pin_memory=device.type == "cuda")
            if self.staged
            else self.tensor
        )
        self.copy_to_host()

    @property
    def array(self) -> np.ndarray:
        """The parameters as a host numpy array: the model's own memory, or its host copy
        (as of the last :meth:`copy_to_host`) when staged."""
        return self._host.detach().numpy()

    def copy_to_host(self) -> None:
        """Make :attr:`array` the model's current parameters (no-op unless staged)."""
        if self.staged:
            self._host.copy_(self.tensor)  # blocking: the host copy is complete on return

    def copy_to_device(self) -> None:
        """Give the model what was written into :attr:`array` (no-op unless staged)."""
        if self.staged:
            self.tensor.copy_(self._host)

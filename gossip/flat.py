"""One flat buffer per model: a message is one contiguous frame, mixing is one vector op."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


class FlatParameters:
    """Moves parameters into one contiguous tensor and makes each parameter a view of it.

    Parameter objects keep their identity, so an optimizer built before or after flattening
    keeps working, and writing into :attr:`array` changes the model in place.
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        unique = list({id(p): p for p in params}.values())
        if not unique:
            raise ValueError("no parameters to flatten")
        dtypes = {p.dtype for p in unique}
        devices = {p.device for p in unique}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"parameters must share one dtype and device, got {dtypes} on {devices}")
        total = sum(p.numel() for p in unique)
        self.tensor = torch.empty(total, dtype=unique[0].dtype, device=unique[0].device)
        offset = 0
        for param in unique:
            n = param.numel()
            view = self.tensor[offset : offset + n]
            view.copy_(param.data.reshape(-1))
            param.data = view.view_as(param)
            offset += n

    @property
    def array(self) -> np.ndarray:
        """The buffer as a numpy array sharing its memory (CPU models)."""
        return self.tensor.detach().numpy()

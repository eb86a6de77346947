"""The array-module seam: the codecs and CHOCO's arithmetic are written once against the module
of the parameters' array, numpy for a model in host memory and cupy for one on a CUDA device,
where every array operation is a kernel on the model's own device memory.

Only the wire crosses between the two: :func:`to_host` stages device frames in pinned host
memory for the socket and :func:`to_device` uploads received ones. :func:`from_torch` and
:func:`to_torch` exchange memory with torch without a copy (DLPack). Numpy arrays pass every
function untouched, so on the CPU the seam costs nothing. cupy is optional
(``pip install 'gossipmesh[gpu]'``) and imported only for a CUDA tensor.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:  # (torch is imported by whoever hands a tensor in: the algorithms need only numpy)
    import torch

Array: TypeAlias = Any
"""A numpy or a cupy ndarray (Any: cupy is optional and ships no type information)."""


def array_module(x: Array) -> ModuleType:
    """cupy for a cupy array, numpy for anything else. Only looked up, never imported here: a
    cupy array exists only once cupy is imported."""
    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None and isinstance(x, cupy.ndarray) else np


def own_memory(array: Array) -> Array | None:
    """``array``, writable, where its memory is its own and no one else's: a received message's
    reassembly buffer (or its upload to the device), which a reader may write over instead of
    copying. None where it is a view of another's memory (a ZeroMQ frame; a sender's tensor
    handed over in memory, which must stay as it was)."""
    if not array.flags.owndata:
        return None
    if isinstance(array, np.ndarray):
        array.flags.writeable = True  # (reassembly hands its buffers on read-only)
    return array


def from_torch(tensor: torch.Tensor) -> Array:
    """The tensor's memory as an array, no copy: numpy for a CPU tensor, cupy (through DLPack)
    for a CUDA one. Writes through either side show in the other."""
    if tensor.device.type == "cpu":
        return tensor.detach().numpy()
    if tensor.device.type != "cuda":
        raise ValueError(f"gossip averages CPU or CUDA tensors, not {tensor.device}; move the model there")
    try:
        cupy = importlib.import_module("cupy")
    except ImportError:
        raise RuntimeError(
            f"a model on {tensor.device} needs cupy: pip install 'gossipmesh[gpu]' (cupy-cuda12x)"
        ) from None
    return cupy.from_dlpack(tensor.detach())


def shares_memory(tensor: torch.Tensor) -> bool:
    """Whether :func:`from_torch` can hand out the tensor's memory here: a CPU tensor, or one on
    the first CUDA device with cupy installed (cupy's kernels run on its current device, 0)."""
    if tensor.device.type == "cpu":
        return True
    return (
        tensor.device.type == "cuda"
        and not tensor.device.index
        and importlib.util.find_spec("cupy") is not None
    )


def to_torch(array: Array) -> torch.Tensor:
    """The array's memory as a tensor, no copy (DLPack, for numpy arrays too)."""
    from torch.utils.dlpack import from_dlpack

    return from_dlpack(array)


def to_host(frames: Sequence[Array]) -> list[np.ndarray]:
    """Frames the socket can send: numpy arrays as they are, device arrays copied into pinned
    host memory. The pinned buffers come from cupy's pool and go back to it when their last
    holder (a send queue, a receiver's inbox) drops them, so steady rounds reuse the same
    buffers without writing into a frame that is still queued."""
    return [frame if isinstance(frame, np.ndarray) else _pinned_copy(frame) for frame in frames]


def to_device(frames: Sequence[np.ndarray], like: Array) -> list[Array]:
    """Received frames where ``like`` lives: uploaded for a device array, untouched for numpy."""
    xp = array_module(like)
    return [xp.asarray(frame) for frame in frames]


def _pinned_copy(frame: Array) -> np.ndarray:
    host: np.ndarray = importlib.import_module("cupyx").empty_pinned(frame.shape, frame.dtype)
    frame.get(out=host)
    return host

"""The staged upload that overlaps the next forward pass (``gossip.buffers.staging``), on the CPU: a copy
stream that runs a chunk's copy only when the compute side waits for it, the slowest a CUDA
copy stream could be, shows each module waiting for its own parameters and for nothing else."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from helpers import run_together
from torch.func import functional_call

from gossip import FlatParameters, GossipOptimizer
from gossip.buffers.staging import plan_chunks
from gossipmesh.sim.memory import MemoryNetwork

CHUNK = 100  # elements: a 16x16 layer (272 values) spans three chunks


class DeferredCopies:
    """A copy stream whose copies run when the compute side waits for them (or on a drain)."""

    def __init__(self) -> None:
        self.queued: dict[int, list[Callable[[], None]]] = {}

    def begin(self) -> None:
        pass

    def run(self, index: int, copy: Callable[[], None]) -> None:
        self.queued.setdefault(index, []).append(copy)

    def wait(self, index: int) -> None:
        for copy in self.queued.pop(index, []):
            copy()

    def drain(self) -> None:
        for index in sorted(self.queued):
            self.wait(index)


def _model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)]
    return torch.nn.Sequential(*layers).to(dtype)


def _values(module: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()]).numpy()


def _with(model: torch.nn.Module, vector: np.ndarray) -> dict[str, torch.Tensor]:
    """The model's parameters as ``vector`` gives them (for a functional call)."""
    params, offset = {}, 0
    for name, param in model.named_parameters():
        part = torch.from_numpy(vector[offset : offset + param.numel()].copy())
        params[name] = part.view_as(param).to(param.dtype)
        offset += param.numel()
    return params


def test_chunks_cut_each_bucket_and_cover_the_vector_once() -> None:
    host = torch.arange(350.0)
    buckets = [torch.zeros(250, dtype=torch.bfloat16), torch.zeros(100)]
    chunks = plan_chunks(host, buckets, size=CHUNK)
    assert [(c.host[0].item(), c.host.numel(), c.device.dtype) for c in chunks] == [
        (0.0, 100, torch.bfloat16),
        (100.0, 100, torch.bfloat16),
        (200.0, 50, torch.bfloat16),  # a chunk ends where its bucket ends
        (250.0, 100, torch.float32),
    ]


def _deferred(model: torch.nn.Module) -> tuple[FlatParameters, DeferredCopies, np.ndarray, np.ndarray]:
    """A staged model with hooks whose host copy was changed and whose upload is queued:
    (flat, its copy stream, the values before, the values uploading)."""
    copies = DeferredCopies()
    flat = FlatParameters(model.parameters(), staged=True, chunk=CHUNK, copies=copies)
    flat.overlap_upload(model)
    old = flat.array.copy()
    flat.array[:] += 1.0
    new = flat.array.copy()
    flat.copy_to_device(blocking=False)
    assert len(copies.queued) == -(-new.size // CHUNK)  # queued, nothing copied yet
    np.testing.assert_array_equal(_values(model), old)
    return flat, copies, old, new


def test_each_block_waits_only_for_the_chunks_of_its_own_parameters() -> None:
    model = _model(0)  # a Sequential: its layers are the blocks
    _, copies, old, new = _deferred(model)
    x = torch.randn(3, 16)
    model[0](x)  # the first layer's forward: values 0..272, in chunks 0..2 (0..300)
    np.testing.assert_array_equal(_values(model[0]), new[:272])
    np.testing.assert_array_equal(_values(model)[300:], old[300:])  # the rest still uploading
    assert sorted(copies.queued) == list(range(3, -(-new.size // CHUNK)))

    out = model(x)  # each layer waits for its own chunks on the way
    assert not copies.queued
    np.testing.assert_array_equal(_values(model), new)
    torch.testing.assert_close(out, functional_call(_model(0), _with(model, new), (x,)), rtol=0, atol=0)


class Tower(torch.nn.Module):
    """An embedding, blocks that read their children's weights without calling them (torch's
    fused encoder layer does, in inference), and a head: parameters outside the blocks at both
    ends of the vector."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
            for _ in range(3)
        )
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)  # type: ignore[no-any-return]


def test_the_rest_of_the_model_uploads_first_and_each_block_sees_all_of_its_own() -> None:
    model = Tower().eval()
    flat, copies, _, new = _deferred(model)
    embed, head = model.embed.weight.numel() + 16, model.head.weight.numel() + 4
    rest = {i for i in range(len(copies.queued)) if i * CHUNK < embed or (i + 1) * CHUNK > new.size - head}
    assert list(copies.queued)[: len(rest)] == sorted(rest)  # embedding and head first, then the blocks
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        out = model(x)
    np.testing.assert_array_equal(_values(model), new)
    with torch.no_grad():
        expected = functional_call(Tower().eval(), _with(model, new), (x,))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert flat.uploads_in_background


def test_a_narrower_model_is_rounded_once_chunk_by_chunk() -> None:
    model = torch.nn.Sequential(_model(0, torch.bfloat16), _model(1))  # a bfloat16 and a float32 bucket
    flat = FlatParameters(model.parameters(), chunk=CHUNK)
    assert len(flat.buckets) == 2 and flat.array.dtype == np.float32
    flat.array[:] += np.float32(1e-3)  # between two bfloat16 values
    mixed = flat.array.copy()
    flat.copy_to_device()
    bf16 = flat.buckets[0].numel()
    np.testing.assert_array_equal(
        flat.buckets[0].float().numpy(), torch.from_numpy(mixed[:bf16]).bfloat16().float()
    )
    np.testing.assert_array_equal(flat.buckets[1].numpy(), mixed[bf16:])
    flat.array[:] = 0
    flat.copy_to_host()
    np.testing.assert_array_equal(flat.array[:bf16], flat.buckets[0].float().numpy())  # widened exactly


def _one_round(*, overlap: bool) -> tuple[list[torch.nn.Sequential], list[np.ndarray]]:
    """Two nodes, each on a staged model whose uploads are deferred, averaging once (D-PSGD, lr
    0): the models and what each started from."""
    network = MemoryNetwork()
    models = [_model(0), _model(1)]
    starts = [_values(m) for m in models]
    optimizers = []
    for model, name in zip(models, ("a", "b"), strict=True):
        optimizer = GossipOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), peer=network.join(name), staged=True
        )
        optimizer.flat.stager.copies = DeferredCopies()
        if overlap:
            optimizer.overlap_upload(model)
        optimizers.append(optimizer)
    run_together(o.step for o in optimizers)
    for optimizer in optimizers:
        optimizer.close()
    return models, starts


def test_after_a_round_the_next_forward_pass_sees_the_mixed_model() -> None:
    x = torch.randn(5, 16)
    models, starts = _one_round(overlap=True)
    mean = (starts[0] + starts[1]) / 2
    for model, start in zip(models, starts, strict=True):
        np.testing.assert_array_equal(_values(model), start)  # still uploading...
        out = model(x)  # ...the forward pass waits for it, module by module
        np.testing.assert_allclose(_values(model), mean, rtol=0, atol=1e-7)
        torch.testing.assert_close(out, functional_call(_model(0), _with(model, _values(model)), (x,)))


def test_without_the_hooks_the_round_waits_for_the_whole_upload() -> None:
    models, starts = _one_round(overlap=False)
    for model in models:
        np.testing.assert_allclose(_values(model), (starts[0] + starts[1]) / 2, rtol=0, atol=1e-7)

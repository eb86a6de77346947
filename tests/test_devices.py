"""Nodes whose model is not in host memory: the staged path (a host copy of the flat parameters,
copied to and from the device around mixing) runs here on the CPU with ``staged=True``; a CUDA
device runs the same lines (``bench/gpu_check.py`` checks that on a GPU machine)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_together

from gossip import Algorithm, Codec, FlatParameters, GossipOptimizer
from gossipmesh.config import ConfigError, MeshConfig, NodeConfig, load
from gossipmesh.sim.memory import MemoryNetwork
from topologies import Topology


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def test_a_staged_host_copy_changes_only_when_copied() -> None:
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    flat = FlatParameters(model.parameters(), staged=True)
    start = flat.array.copy()
    np.testing.assert_array_equal(start, flat.tensor.numpy())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    np.testing.assert_array_equal(flat.array, start)  # the step is on the "device" only
    flat.copy_to_host()
    np.testing.assert_array_equal(flat.array, flat.tensor.numpy())
    assert not np.array_equal(flat.array, start)
    flat.array[:] = 0.5
    assert all(bool((p != 0.5).any()) for p in model.parameters())
    flat.copy_to_device()
    assert all(bool((p == 0.5).all()) for p in model.parameters())


def _train_pair(
    staged: tuple[bool, bool], *, algorithm: str, steps: int, **options: object
) -> list[np.ndarray]:
    """Two nodes on an in-memory network training one regression each (different data), in
    threads; the final flat parameters of each."""
    network = MemoryNetwork()
    peers = [network.join(name) for name in ("a", "b")]
    models = [_model(0), _model(0)]
    optimizers = [
        GossipOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            peer=p,
            algorithm=Algorithm.parse(algorithm),
            topology=Topology("ring"),
            staged=s,
            **options,  # type: ignore[arg-type]
        )
        for m, p, s in zip(models, peers, staged, strict=True)
    ]

    def train(rank: int) -> None:
        generator = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            inputs = torch.randn(16, 4, generator=generator)
            loss = (models[rank](inputs).squeeze(1) - inputs.sum(1) * (rank + 1)).pow(2).mean()
            optimizers[rank].zero_grad()
            loss.backward()
            optimizers[rank].step()
            if optimizers[rank].averager.mixes_in_background:
                time.sleep(0.002)  # let the exchanger run between steps

    run_together(partial(train, rank) for rank in range(2))
    for optimizer in optimizers:
        optimizer.close()
    return [o.flat.tensor.detach().numpy().copy() for o in optimizers]


@pytest.mark.parametrize(
    "options",
    [{"average_every": 1}, {"average_every": 3}, {"average_every": 4, "outer_lr": 0.7}],
    ids=["every-step", "every-3", "diloco-4"],
)
def test_a_staged_node_trains_exactly_as_a_host_node(options: dict[str, object]) -> None:
    """Synchronous D-PSGD with one node staged gives the same parameters, bit for bit, as with
    none: the staged copies move exactly what mixing reads and writes."""
    plain = _train_pair((False, False), algorithm="dpsgd", steps=24, **options)
    mixed = _train_pair((True, False), algorithm="dpsgd", steps=24, **options)
    _assert_same(mixed, plain)


def test_staged_choco_mixes_the_models_own_memory_and_trains_exactly_as_a_host_node() -> None:
    """CHOCO on a staged model works on the model's memory through the array seam (cupy kernels
    on a GPU); only what else reads the parameters goes through the host copy."""
    network = MemoryNetwork()
    staged = {
        name: GossipOptimizer(
            torch.optim.SGD(_model(0).parameters(), lr=0.1),
            peer=network.join(name),
            algorithm=Algorithm(name),
            staged=True,
        )
        for name in ("choco", "dpsgd")
    }
    assert staged["choco"].mixes_in_place and not staged["dpsgd"].mixes_in_place
    plain = _train_pair((False, False), algorithm="choco", steps=30, compression=Codec.parse("int8"))
    mixed = _train_pair((True, True), algorithm="choco", steps=30, compression=Codec.parse("int8"))
    _assert_same(mixed, plain)


def _assert_same(mixed: list[np.ndarray], plain: list[np.ndarray]) -> None:
    for ours, theirs in zip(mixed, plain, strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert not np.array_equal(plain[0], _model_array(0))  # it trained


def _model_array(seed: int) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in _model(seed).parameters()]).numpy()


def test_background_mixing_reaches_a_staged_model_and_is_never_lost() -> None:
    """AD-PSGD mixes the host copy at any time. With lr 0 pairwise averaging must keep the sum
    of the two models exactly and bring them together: a mixing overwritten by a copy from the
    device, or never copied to it, breaks the sum."""
    network = MemoryNetwork()
    peers = [network.join(name) for name in ("a", "b")]
    models = [_model(0), _model(1)]
    total = sum(_model_array(s) for s in (0, 1))
    optimizers = [
        GossipOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.0), peer=p, algorithm=Algorithm("adpsgd"), staged=True
        )
        for m, p in zip(models, peers, strict=True)
    ]
    while min(o.averager.exchanges for o in optimizers) < 20:
        for optimizer in optimizers:
            optimizer.step()
        time.sleep(0.005)
    for optimizer in optimizers:
        optimizer.close()
        optimizer.step()  # the last mixing reaches the device
    finals = [o.flat.tensor.numpy() for o in optimizers]
    assert min(o.averager.exchanges for o in optimizers) >= 20
    np.testing.assert_allclose(finals[0] + finals[1], total, atol=1e-5)
    np.testing.assert_allclose(finals[0], finals[1], atol=1e-5)


def test_device_flags_are_checked() -> None:
    assert load(NodeConfig, {"insecure": True, "device": "cpu"}).device == "cpu"
    with pytest.raises(ConfigError, match=re.escape("--device: 'tpu0': choose cpu, cuda or cuda:INDEX")):
        load(NodeConfig, {"insecure": True, "device": "tpu0"})
    if not torch.cuda.is_available():
        with pytest.raises(
            ConfigError, match=re.escape("--device: 'cuda:1': this torch build sees no CUDA device 1 ")
        ):
            load(NodeConfig, {"insecure": True, "device": "cuda:1"})
    assert load(MeshConfig, {"nodes": "3", "node_device": ["2:cpu"]}).by_rank("node_device") == {2: "cpu"}
    with pytest.raises(ConfigError, match=re.escape("--node-device: '5:cpu': rank 5 is not in 0..2")):
        load(MeshConfig, {"nodes": "3", "node_device": ["5:cpu"]})


@pytest.mark.mesh
def test_the_gpu_check_passes_its_dry_run_through_the_staged_path_on_the_cpu() -> None:
    """``bench/gpu_check.py`` is what a GPU machine runs first; its CPU dry run keeps it working."""
    script = Path(__file__).parent.parent / "bench" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    verdicts = [
        line for line in done.stdout.splitlines() if line.endswith(("ok", "ok |", "FAILED", "FAILED |"))
    ]
    # mixing x2, state transfer, 3 meshes, machines of local ranks (whole and sharded), overlapped upload x2
    assert len(verdicts) == 2 + 1 + 3 + 2 + 2 and not any("FAILED" in line for line in verdicts), done.stdout

"""Checks and times a node whose model is on a GPU, in one go on a machine with one.

    python bench/gpu_check.py                 # needs torch with CUDA; exits 2 without it
    python bench/gpu_check.py --device cpu    # the same checks through the staged path on the CPU

1. Mixing through the pinned host copy: a node on the device and a node on the CPU averaging
   (D-PSGD, lr 0) on an in-memory network keep the exact mean of their models and meet.
2. A real mesh of 3 daemons with node 0 on the device trains every node to the target accuracy:
   with D-PSGD (mixing the pinned host copy) and with CHOCO int8 (mixing on the device itself
   when cupy is installed; see ``bench/gpu_codec.py`` for the codecs alone).
3. Copy throughput between the device and the pinned host copy (GB/s), per model size.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import torch
from meshrun import quiet_mesh

from gossip import FlatParameters, GossipOptimizer
from gossipmesh.sim.memory import MemoryNetwork

TARGET = 0.93
SIZES = (10**6, 10**7, 10**8)
MESHES = {"dpsgd": [], "choco int8": ["--algorithm", "choco", "--compression", "int8"]}


def check_mixing(device: str, rounds: int = 40) -> tuple[float, float]:
    """The error of the mean (relative) and the distance between the two nodes after ``rounds``."""
    network = MemoryNetwork()
    models = []
    for seed, where in ((0, device), (1, "cpu")):
        torch.manual_seed(seed)
        models.append(torch.nn.Linear(256, 256).to(where))
    start = [torch.cat([p.detach().cpu().reshape(-1) for p in m.parameters()]).numpy() for m in models]
    optimizers = [
        GossipOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), peer=network.join(name), staged=True)
        for m, name in zip(models, ("gpu", "cpu"), strict=True)
    ]

    def run(optimizer: GossipOptimizer) -> None:
        for _ in range(rounds):
            optimizer.step()

    threads = [threading.Thread(target=run, args=(o,)) for o in optimizers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    finals = [o.flat.tensor.detach().cpu().numpy() for o in optimizers]
    mean = (start[0] + start[1]) / 2
    error = float(np.abs((finals[0] + finals[1]) / 2 - mean).max() / np.abs(mean).max())
    return error, float(np.abs(finals[0] - finals[1]).max())


def check_mesh(device: str, flags: list[str]) -> list[float]:
    report = quiet_mesh(
        ["--nodes", "3", "--steps", "400", "--insecure", "--node-device", f"0:{device}", *flags]
    )
    devices = [n["device"] for n in report["nodes"]]
    if devices[0] != device:
        raise RuntimeError(f"node 0 trained on {devices[0]}, not {device}")
    return [n["final"]["accuracy"] for n in report["nodes"]]


def copy_throughput(device: str, size: int, repeat: int = 5) -> tuple[float, float]:
    """GB/s of (device to pinned host, pinned host to device) for ``size`` float32s."""
    flat = FlatParameters([torch.zeros(size, device=device)], staged=True)
    rates = []
    for copy in (flat.copy_to_host, flat.copy_to_device):
        copy()
        started = time.perf_counter()
        for _ in range(repeat):
            copy()
        if device != "cpu":
            torch.cuda.synchronize()
        rates.append(repeat * size * 4 / (time.perf_counter() - started) / 1e9)
    return rates[0], rates[1]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="the device to check (default cuda)")
    device = parser.parse_args().device
    if device != "cpu" and not torch.cuda.is_available():
        print(
            "gpu_check: this needs torch with CUDA and a GPU (or --device cpu for a dry run)", file=sys.stderr
        )
        return 2
    failures = 0
    error, gap = check_mixing(device)
    ok = error < 1e-6 and gap < 1e-6
    failures += not ok
    print(f"mixing {device} with cpu: mean error {error:.2e}, gap {gap:.2e}  {'ok' if ok else 'FAILED'}")
    for name, flags in MESHES.items():
        accuracies = check_mesh(device, flags)
        ok = min(accuracies) >= TARGET
        failures += not ok
        shown = ", ".join(f"{a:.3f}" for a in accuracies)
        print(
            f"{name} mesh, node 0 on {device}: accuracy {shown} (target {TARGET})  {'ok' if ok else 'FAILED'}"
        )
    print(f"\n| float32s | {device} -> host copy GB/s | host copy -> {device} GB/s |\n|---|---|---|")
    for size in SIZES:
        down, up = copy_throughput(device, size)
        print(f"| {size:.0e} | {down:.2f} | {up:.2f} |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Checks and times a node whose model is on a GPU, in one go on a machine with one.

    python bench/gpu_check.py                 # needs torch with CUDA; exits 2 without it
    python bench/gpu_check.py --device cpu    # the same checks through the staged path on the CPU

1. Mixing through the pinned host copy: a node on the device and a node on the CPU averaging
   (D-PSGD, lr 0) on an in-memory network keep the exact mean of their models and meet; the
   same in bfloat16 (the mean within a bfloat16 rounding: mixing accumulates in float32).
2. A newcomer whose model is on the device takes an AdamW state from a member on the CPU (and the
   other way round), read chunk by chunk from the live model: every value arrives exactly.
3. A real mesh of 3 daemons with node 0 on the device trains every node to the target accuracy:
   with D-PSGD (mixing the pinned host copy), in bfloat16 (``--dtype bfloat16``) and with CHOCO
   int8 (mixing on the device itself when cupy is installed; see ``bench/gpu_codec.py``).
4. Copy throughput between the device and the pinned host copy (GB/s), per model size.
6. A mesh of 2 machines of 2 local ranks each (``--local-ranks 2``: one device per rank, NCCL
   inside the machine; gloo with ``--device cpu``) trains to the target with bitwise-equal
   parameters on the ranks of each machine; and the same with ``--shard`` (FSDP2 over the
   machine's 2 devices, NCCL's all-gather and reduce-scatter): each rank holds half of the
   parameters and optimizer state, and the machines train to the target all the same. Needs 2
   GPUs (skipped, and said, with fewer).
5. The upload of mixed parameters overlapping the next forward pass (``gossip.buffers.staging``), in
   float32 and bfloat16: the forward pass after an overlapped upload gives bitwise the output
   of one after a blocking upload, and the time of upload + forward, blocking against
   overlapped, beside the upload alone and the forward alone (the most overlap can save is the
   shorter of the two).
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
from gossipmesh.tasks.digits import DigitsTask

TARGET = 0.93
SIZES = (10**6, 10**7, 10**8)
MESHES = {
    "dpsgd": ["--algorithm", "dpsgd"],
    "dpsgd bfloat16": ["--algorithm", "dpsgd", "--dtype", "bfloat16"],
    "choco int8": ["--algorithm", "choco", "--compression", "int8"],
}
BFLOAT16_STEP = 2.0**-7  # relative spacing of bfloat16 values


def check_mixing(device: str, dtype: torch.dtype = torch.float32, rounds: int = 40) -> tuple[float, float]:
    """The error of the mean (relative) and the distance between the two nodes after ``rounds``."""
    network = MemoryNetwork()
    models = []
    for seed, where in ((0, device), (1, "cpu")):
        torch.manual_seed(seed)
        models.append(torch.nn.Linear(256, 256).to(where, dtype))
    start = [
        torch.cat([p.detach().cpu().reshape(-1).double() for p in m.parameters()]).numpy() for m in models
    ]
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
    finals = [o.flat.tensor.detach().cpu().double().numpy() for o in optimizers]
    mean = (start[0] + start[1]) / 2
    error = float(np.abs((finals[0] + finals[1]) / 2 - mean).max() / np.abs(mean).max())
    return error, float(np.abs(finals[0] - finals[1]).max())


def check_state_transfer(device: str) -> bool:
    """Both ways between the device and the CPU: a newcomer's parameters and AdamW state equal
    its source's, taken chunk by chunk from the source's live model."""
    exact = True
    for source_on, newcomer_on in ((device, "cpu"), ("cpu", device)):
        network = MemoryNetwork()
        optimizers = []
        for name, where in (("source", source_on), ("newcomer", newcomer_on)):
            torch.manual_seed(0 if name == "source" else 1)
            model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 10)).to(where)
            optimizers.append(GossipOptimizer(torch.optim.AdamW(model.parameters()), peer=network.join(name)))
        source, newcomer = optimizers
        for param in source.param_groups[0]["params"]:
            param.grad = torch.ones_like(param)
        source.optimizer.step()
        source.step_count = 7
        done = threading.Event()
        serving = threading.Thread(target=_serve_until, args=(source, done))
        serving.start()
        try:
            newcomer.join_from(["source"], timeout=30)
        finally:
            done.set()
            serving.join()
        for ours, theirs in zip(
            newcomer.param_groups[0]["params"], source.param_groups[0]["params"], strict=True
        ):
            exact &= torch.equal(ours.detach().cpu(), theirs.detach().cpu())
            for key in ("exp_avg", "exp_avg_sq", "step"):
                exact &= torch.equal(newcomer.state[ours][key].cpu(), source.state[theirs][key].cpu())
        exact &= newcomer.step_count == 7
    return exact


def _serve_until(optimizer: GossipOptimizer, done: threading.Event) -> None:
    while not done.is_set():
        optimizer.serve_state(0.05)


def check_mesh(device: str, flags: list[str]) -> list[float]:
    report = quiet_mesh(
        ["--nodes", "3", "--steps", "400", "--insecure", "--node-device", f"0:{device}", *flags]
    )
    devices = [n["device"] for n in report["nodes"]]
    if devices[0] != device:
        raise RuntimeError(f"node 0 trained on {devices[0]}, not {device}")
    return [n["final"]["accuracy"] for n in report["nodes"]]


def check_local_ranks(device: str, shard: bool = False) -> tuple[list[float], bool]:
    """Two machines of two local ranks: the accuracies, and whether each machine's ranks ended
    as they should: with bitwise-equal parameters, or with ``shard`` each holding its half."""
    report = quiet_mesh([
        "--nodes", "2", "--local-ranks", "2", "--steps", "300", "--insecure", "--device", device,
        *(["--shard"] if shard else []),
    ])  # fmt: skip
    machines = report["nodes"]
    if shard:
        whole = sum(p.numel() for p in DigitsTask().model(0).parameters())
        fine = all(
            len({r["params_digest"] for r in m["local_ranks"]}) == 2
            and [r["parameters"] * 2 for r in m["local_ranks"]] == [whole, whole]
            for m in machines
        )
    else:
        fine = all(len({r["params_digest"] for r in m["local_ranks"]}) == 1 for m in machines)
    return [m["final"]["accuracy"] for m in machines], fine


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


def check_overlap(device: str, dtype: torch.dtype, repeat: int = 5) -> tuple[bool, dict[str, float]]:
    """(the overlapped forward's output is bitwise the blocking one's, median ms of: upload +
    forward blocking, the same overlapped, upload alone, forward alone)."""
    width, batch = (4096, 16384) if device != "cpu" else (256, 64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).to(device, dtype)
    flat = FlatParameters(model.parameters(), staged=True)
    flat.overlap_upload(model)
    x = torch.randn(batch, width, device=device, dtype=dtype)
    before, after = flat.array.copy(), flat.array * np.float32(0.5)

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    def timed(blocking: bool | None, forward: bool) -> tuple[torch.Tensor | None, float]:
        times, out = [], None
        for _ in range(repeat):
            flat.copy_to_host()  # (waits for the last upload)
            np.copyto(flat.array, before)
            flat.copy_to_device()  # the device holds the old parameters...
            np.copyto(flat.array, after)  # ...and the host the mixed ones
            sync()
            started = time.perf_counter()
            if blocking is not None:
                flat.copy_to_device(blocking=blocking)
            if forward:
                with torch.no_grad():
                    out = model(x)
            sync()
            times.append(time.perf_counter() - started)
        return out, 1e3 * float(np.median(times))

    with torch.no_grad():
        flat.copy_to_device()
        stale = model(x)
    blocking_out, blocking_ms = timed(True, True)
    overlapped_out, overlapped_ms = timed(False, True)
    _, upload_ms = timed(True, False)
    flat.copy_to_device()
    _, forward_ms = timed(None, True)
    assert blocking_out is not None and overlapped_out is not None
    exact = torch.equal(blocking_out, overlapped_out) and not torch.equal(blocking_out, stale)
    return exact, {
        "blocking": blocking_ms,
        "overlapped": overlapped_ms,
        "upload": upload_ms,
        "forward": forward_ms,
    }


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
    for dtype, bound in ((torch.float32, 1e-6), (torch.bfloat16, BFLOAT16_STEP)):
        error, gap = check_mixing(device, dtype)
        ok = error < bound and gap < bound * 4
        failures += not ok
        verdict = "ok" if ok else "FAILED"
        print(f"mixing {device} with cpu, {dtype}: mean error {error:.2e}, gap {gap:.2e}  {verdict}")
    ok = check_state_transfer(device)
    failures += not ok
    verdict = "exact  ok" if ok else "not exact  FAILED"
    print(f"state transfer {device} <-> cpu, AdamW: {verdict}")
    for name, flags in MESHES.items():
        accuracies = check_mesh(device, flags)
        ok = min(accuracies) >= TARGET
        failures += not ok
        shown = ", ".join(f"{a:.3f}" for a in accuracies)
        print(
            f"{name} mesh, node 0 on {device}: accuracy {shown} (target {TARGET})  {'ok' if ok else 'FAILED'}"
        )
    if device == "cpu" or torch.cuda.device_count() >= 2:
        for shard, holding in ((False, "ranks equal"), (True, "each rank a half")):
            accuracies, fine = check_local_ranks(device, shard)
            ok = min(accuracies) >= TARGET and fine
            failures += not ok
            shown = ", ".join(f"{a:.3f}" for a in accuracies)
            print(
                f"2 machines x 2 local ranks{' --shard' if shard else ''} on {device}: accuracy "
                f"{shown}, {holding} {fine}  {'ok' if ok else 'FAILED'}"
            )
    else:
        print(
            f"2 machines x 2 local ranks: skipped, {torch.cuda.device_count()} GPU here "
            "(NCCL needs one a rank)"
        )
    print(f"\n| float32s | {device} -> host copy GB/s | host copy -> {device} GB/s |\n|---|---|---|")
    for size in SIZES:
        down, up = copy_throughput(device, size)
        print(f"| {size:.0e} | {down:.2f} | {up:.2f} |")
    print("\n| model | upload + forward, blocking ms | overlapped ms | upload ms | forward ms | exact |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        exact, ms = check_overlap(device, dtype)
        failures += not exact
        print(
            f"| 8 layers, {dtype} | {ms['blocking']:.1f} | {ms['overlapped']:.1f} | {ms['upload']:.1f} "
            f"| {ms['forward']:.1f} | {'ok' if exact else 'FAILED'} |"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

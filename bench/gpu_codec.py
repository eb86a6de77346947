"""Checks and times the GPU path of the codecs and CHOCO (cupy on a CUDA device) against the CPU
path (numpy): the same code (``gossip.buffers.arrays``) on either, so the GPU must compute the same bits.

Checks, each against numpy on the same input, tolerance 0 (bit for bit):

- codecs: each codec's frames (the wire bytes) and decoded vector, the sparse ones in both
  formats (segments and bitmap), after the round trip a message takes: encode on the device,
  frames staged in pinned host memory, uploaded again, decoded on the device. The input has
  2^20 + 3 elements (a partial int8 block and bitmap byte), distinct magnitudes (top-k has one
  answer; ties are the one place a GPU sort may pick differently), values beyond fp16's range
  and no float32 subnormals (cupy compiles its kernels with flush-to-zero, so on the device a
  subnormal input or result would be 0). randk draws its positions with numpy on both paths.
- validation: malformed frames, uploaded, are refused on the device with the CPU's reason.
- DLPack: an array made from a torch tensor and a tensor made from that array share memory.
- CHOCO: a ring of 4 simulated nodes (virtual time, so the rounds match on both paths) whose
  parameters are views of torch tensors on the device: every model after 12 rounds, with int8,
  bf16 and randk (top-k is checked above only: after mixing, two magnitudes may tie at its
  threshold, and a GPU sort may keep the other one).

Then throughput in GB/s of float32 input, best of ``--repeat`` after a warm-up: "send" is
encode + the frames staged in host memory, "receive" is uploading received frames (from
pageable memory, as a socket leaves them) + decode.

    pip install -e '.[gpu]'   # cupy-cuda12x, with a CUDA build of torch
    python bench/gpu_codec.py [--sizes 1e6,1e7,1e8] [--repeat 3]

Exit status: 0 when every check passes, 1 when one fails, 2 without cupy, a CUDA device or a
CUDA build of torch.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gossip import CHOCO, Codec, CodecError
from gossip.buffers.arrays import from_torch, to_device, to_host, to_torch
from gossip.compression import INT8_BLOCK
from gossipmesh.sim.clock import VirtualClock
from gossipmesh.sim.links import VirtualNetwork
from topologies import Topology

CHECKED = (
    *("none", "fp16", "bf16", "int8", "topk:0.01", "topk:0.2", "randk:0.01", "randk:0.2"),
    "topk:0.01,values=float32",
)
TIMED = ("none", "fp16", "bf16", "int8", "topk:0.01", "randk:0.01")
CHOCO_CODECS = ("int8", "bf16", "randk:0.1")  # not top-k: mixed values can tie at its threshold
# A sparse codec's adaptive step size is a reduction, summed in another order on the device (the
# last bits of γ differ): the check fixes it at what randk:0.1 adapts to.
CHOCO_GAMMA = {"randk:0.1": 0.1}
CHECK_SIZE = (1 << 20) + 3
CHOCO_NODES, CHOCO_ROUNDS, CHOCO_SIZE = 4, 12, 100_003
SEED = 7


class NoDeviceError(Exception):
    """What the GPU path needs and this machine lacks, and how to get it."""


@dataclass(frozen=True)
class Device:
    """Where the checked path runs."""

    name: str
    upload: Callable[[np.ndarray], Any]  # a host array onto the device
    torch_device: str  # the torch device whose memory the arrays view
    synchronize: Callable[[], None]  # waits until the device's queued work is done


CPU = Device("numpy", np.asarray, "cpu", lambda: None)


def cuda() -> Device:
    """The first CUDA device, through cupy."""
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, or cupy's CUDARuntimeError without a driver or device
        raise NoDeviceError(
            "cupy with a CUDA device: pip install -e '.[gpu]' on a machine with an NVIDIA GPU "
            f"and driver ({type(exc).__name__}: {exc})"
        ) from None
    if not torch.cuda.is_available():
        raise NoDeviceError(
            f"a CUDA build of torch, not {torch.__version__}: "
            'make venv TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"'
        )
    name = f"{torch.cuda.get_device_name()}, cupy {cupy.__version__}, torch {torch.__version__}"
    return Device(name, cupy.asarray, "cuda", cupy.cuda.runtime.deviceSynchronize)


# -- checks ------------------------------------------------------------------------------------


def check_vector() -> np.ndarray:
    """The codecs' input: see the module docstring."""
    rng = np.random.default_rng(SEED)
    magnitudes = (rng.permutation(CHECK_SIZE) + 1) * 2.0**-17  # distinct, exact, >= 2^-17
    x = (magnitudes * rng.choice([-1.0, 1.0], CHECK_SIZE)).astype(np.float32)
    x[:INT8_BLOCK] = 0.0  # an all-zero int8 block
    x[-2:] = [1e6, -3.4e38]  # clipped by fp16; bf16 keeps the second finite
    return x


@dataclass(frozen=True)
class Trip:
    """A codec's round trip as the wire and the receiver see it."""

    frames: list[np.ndarray]
    meta: dict[str, Any]
    decoded: np.ndarray


def round_trip(device: Device, spec: str, x: np.ndarray) -> Trip:
    codec = Codec.parse(spec, seed=SEED)
    values = device.upload(x)
    encoded = codec.encode(values)
    frames = to_host(encoded.frames)
    decoded = codec.decode(to_device(frames, values), encoded.meta, x.size)
    return Trip(frames, encoded.meta, to_host([decoded])[0])


def mismatch(name: str, cpu: np.ndarray, device: np.ndarray) -> str | None:
    """How ``device`` differs from ``cpu`` bit for bit; None when it does not."""
    if cpu.dtype != device.dtype or cpu.shape != device.shape:
        return (
            f"{name} is {device.dtype}{list(device.shape)} on the device, "
            f"{cpu.dtype}{list(cpu.shape)} on the CPU"
        )
    bits = np.dtype(f"u{cpu.itemsize}")
    differ = np.flatnonzero(cpu.view(bits) != device.view(bits))
    if not differ.size:
        return None
    i = differ[0]
    return (
        f"{name}: {differ.size} of {cpu.size} elements differ, first [{i}]: {device[i]} on the "
        f"device, {cpu[i]} on the CPU"
    )


def check_codecs(device: Device, x: np.ndarray) -> list[str]:
    failures = []
    for spec in CHECKED:
        cpu, dev = round_trip(CPU, spec, x), round_trip(device, spec, x)
        if cpu.meta != dev.meta or len(cpu.frames) != len(dev.frames):
            failures.append(
                f"{spec}: {len(dev.frames)} frames {dev.meta}, on the CPU {len(cpu.frames)} {cpu.meta}"
            )
            continue
        named = [(f"frame {i}", a, b) for i, (a, b) in enumerate(zip(cpu.frames, dev.frames, strict=True))]
        found = (mismatch(name, a, b) for name, a, b in [*named, ("decoded", cpu.decoded, dev.decoded)])
        failures += [f"{spec}: {f}" for f in found if f]
    return failures


def malformed(x: np.ndarray) -> list[tuple[str, list[np.ndarray], dict[str, Any], str]]:
    """(codec, frames, meta, the reason to refuse them): corrupted encodings of ``x``."""
    scales, q = Codec.parse("int8").encode(x).frames
    exact = "topk:0.2,values=float32"  # a bitmap and float32 values
    segments, bitmap = Codec.parse("topk:0.01").encode(x), Codec.parse(exact).encode(x)
    counts, offsets, kept_scales, kept_q = segments.frames
    bits, kept = bitmap.frames
    sparse = segments.meta
    return [
        ("none", [x[:-1]], {}, "codec_shape"),
        ("int8", [_with(scales, 0, np.inf), q], {}, "non_finite"),
        ("topk:0.01", [_with(counts, 0, counts[0] + 1), offsets, kept_scales, kept_q], sparse, "codec_index"),
        ("topk:0.01", [counts, _with(offsets, 1, offsets[0]), kept_scales, kept_q], sparse, "codec_index"),
        ("topk:0.01", [counts, offsets, _with(kept_scales, 0, np.nan), kept_q], sparse, "non_finite"),
        (exact, [_with(bits, -1, bits[-1] | 1), kept], bitmap.meta, "codec_index"),  # a padding bit
        (exact, [bits, kept], {"sparse": "zip"}, "codec_format"),
    ]  # fmt: skip


def _with(array: np.ndarray, i: int, value: Any) -> np.ndarray:
    changed = array.copy()
    changed[i] = value
    return changed


def refusal(like: Any, spec: str, frames: list[np.ndarray], meta: dict[str, Any], size: int) -> str:
    """Why decoding the frames, uploaded where ``like`` lives, fails ("accepted" if it does not)."""
    try:
        Codec.parse(spec).decode(to_device(frames, like), meta, size)
    except CodecError as error:
        return error.reason
    return "accepted"


def check_validation(device: Device, x: np.ndarray) -> list[str]:
    failures = []
    likes = {"CPU": x[:1], "device": device.upload(x[:1])}
    for spec, frames, meta, reason in malformed(x):
        got = {path: refusal(like, spec, frames, meta, x.size) for path, like in likes.items()}
        if set(got.values()) != {reason}:
            failures.append(f"malformed {spec} frames {meta}: expected {reason}, got {got}")
    return failures


def check_dlpack(device: Device) -> list[str]:
    tensor = torch.zeros(4, device=device.torch_device)
    array = from_torch(tensor)
    array += 1
    to_torch(array).add_(1)
    seen = tensor.tolist()
    return [] if seen == [2.0] * 4 else [f"DLPack: two writes through views left the tensor at {seen}"]


def choco_starts() -> np.ndarray:
    """The CHOCO nodes' models before the rounds, one row each."""
    return np.random.default_rng(SEED).standard_normal((CHOCO_NODES, CHOCO_SIZE)).astype(np.float32)


def choco_models(device: Device, spec: str) -> list[np.ndarray]:
    """Every node's model after CHOCO_ROUNDS rounds of pure averaging on a simulated ring, with
    its parameters a view of a torch tensor on ``device``."""
    starts = choco_starts()
    clock = VirtualClock()
    network = VirtualNetwork(clock)
    tensors = [torch.from_numpy(start).to(device.torch_device) for start in starts]
    for i, tensor in enumerate(tensors):
        node = CHOCO(
            network.join(f"node-{i}"),
            from_torch(tensor),
            topology=Topology.parse("ring"),
            codec=Codec.parse(spec, seed=i),
            gamma=CHOCO_GAMMA.get(spec),
        )

        def rounds(node: CHOCO = node) -> None:
            for _ in range(CHOCO_ROUNDS):
                node.after_step()

        clock.spawn(f"node-{i}", f"node-{i}", rounds)
    clock.run()
    device.synchronize()
    return [tensor.cpu().numpy() for tensor in tensors]


def check_choco(device: Device) -> list[str]:
    failures = []
    for spec in CHOCO_CODECS:
        models = zip(choco_models(CPU, spec), choco_models(device, spec), strict=True)
        found = (mismatch(f"node-{i}'s model", a, b) for i, (a, b) in enumerate(models))
        failures += [f"CHOCO {spec}: {f}" for f in found if f]
    return failures


def checks(device: Device) -> list[str]:
    """Every check's failures (empty when the device computes what numpy does)."""
    x = check_vector()
    return check_codecs(device, x) + check_validation(device, x) + check_dlpack(device) + check_choco(device)


# -- throughput --------------------------------------------------------------------------------


def best_time(device: Device, repeat: int, work: Callable[[], object]) -> float:
    """Seconds of the fastest of ``repeat`` runs of ``work`` after a warm-up, each until the
    device is idle."""
    times = []
    for _ in range(repeat + 1):
        device.synchronize()
        started = time.perf_counter()
        work()
        device.synchronize()
        times.append(time.perf_counter() - started)
    return min(times[1:])


def throughput(device: Device, spec: str, host: np.ndarray, repeat: int) -> tuple[float, float]:
    """GB/s of float32 input through the send and the receive path (module docstring)."""
    x = device.upload(host)
    codec = Codec.parse(spec, seed=SEED)
    encoded = codec.encode(x)
    received = [np.array(frame) for frame in to_host(encoded.frames)]  # pageable, as from a socket
    send = best_time(device, repeat, lambda: to_host(codec.encode(x).frames))
    receive = best_time(device, repeat, lambda: codec.decode(to_device(received, x), encoded.meta, x.size))
    return host.nbytes / send / 1e9, host.nbytes / receive / 1e9


def table(device: Device, sizes: Sequence[int], repeat: int) -> list[str]:
    lines = [
        f"{'codec':<11} {'elements':>8} {'send GB/s: CPU':>15} {'device':>8} {'x':>6} "
        f"{'receive GB/s: CPU':>18} {'device':>8} {'x':>6}"
    ]
    for n in sizes:
        host = np.random.default_rng(SEED).standard_normal(n, dtype=np.float32)
        for spec in TIMED:
            (cpu_send, cpu_receive), (send, receive) = (
                throughput(d, spec, host, repeat) for d in (CPU, device)
            )
            lines.append(
                f"{spec:<11} {n:>8.0e} {cpu_send:>15.2f} {send:>8.2f} {send / cpu_send:>6.1f} "
                f"{cpu_receive:>18.2f} {receive:>8.2f} {receive / cpu_receive:>6.1f}"
            )
    return lines


def run(device: Device, sizes: Sequence[int], repeat: int) -> int:
    """Check, then time; prints both and returns the exit status."""
    print(f"device: {device.name}", flush=True)
    failures = checks(device)
    for failure in failures:
        print(f"FAIL {failure}")
    print(
        f"checks against numpy, bit for bit: {len(CHECKED)} codecs, {len(malformed(check_vector()))} "
        f"malformed inputs, DLPack, CHOCO with {', '.join(CHOCO_CODECS)}: "
        + (f"{len(failures)} failed" if failures else "all passed"),
        flush=True,
    )
    print("\n".join(table(device, sizes, repeat)))
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1e6,1e7,1e8", help="float32 elements of the timed vectors")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (best taken)")
    args = parser.parse_args()
    sizes = [int(float(size)) for size in args.sizes.split(",")]
    try:
        device = cuda()
    except NoDeviceError as missing:
        print(f"bench/gpu_codec.py checks the GPU path and needs {missing}", file=sys.stderr)
        return 2
    return run(device, sizes, args.repeat)


if __name__ == "__main__":
    sys.exit(main())

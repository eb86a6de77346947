"""The GPU path: the array seam (``gossip.buffers.arrays``) and ``bench/gpu_codec.py``. CI has no GPU, so
the bench's checks run here with numpy standing in for the device (every line but cupy's own);
on a machine with a CUDA GPU and cupy they run against the device too."""

from __future__ import annotations

import dataclasses
import math
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gpu_codec
import numpy as np
import pytest
import torch

from gossip import consensus_distance
from gossip.buffers.arrays import array_module, from_torch, to_device, to_host
from gossip.compression import INT8_BLOCK


def cuda_or_reason() -> gpu_codec.Device | str:
    try:
        return gpu_codec.cuda()
    except gpu_codec.NoDeviceError as missing:
        return str(missing)


def test_numpy_arrays_pass_the_seam_untouched() -> None:
    frames = [np.arange(3, dtype=np.float32), np.zeros(2, dtype=np.uint8)]
    assert array_module(frames[0]) is np
    assert all(a is b for a, b in zip(to_host(frames), frames, strict=True))
    assert all(a is b for a, b in zip(to_device(frames, frames[0]), frames, strict=True))
    tensor = torch.zeros(3)
    from_torch(tensor)[1] = 5.0
    assert tensor.tolist() == [0.0, 5.0, 0.0]
    with pytest.raises(ValueError, match="gossip averages CPU or CUDA tensors, not meta"):
        from_torch(torch.zeros(1, device="meta"))


def test_device_frames_are_staged_in_a_new_pinned_buffer_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sent frame may still sit in a queue or an inbox: staging never writes into it again.
    (cupy and cupyx faked: only what to_host asks of them.)"""

    class DeviceArray:
        def __init__(self, data: np.ndarray) -> None:
            self.data, self.shape, self.dtype = data, data.shape, data.dtype

        def get(self, out: np.ndarray) -> None:
            out[...] = self.data

    pinned: list[np.ndarray] = []

    def empty_pinned(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        pinned.append(np.empty(shape, dtype))
        return pinned[-1]

    cupy = types.SimpleNamespace(ndarray=DeviceArray)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=empty_pinned))
    frame = DeviceArray(np.arange(4, dtype=np.float32))
    assert array_module(frame) is cupy and array_module(frame.data) is np
    first, second = to_host([frame])[0], to_host([frame])[0]
    assert first is pinned[0] and second is pinned[1] and first.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_bench_passes_with_numpy_standing_in_for_the_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_codec.run(gpu_codec.CPU, sizes=[10_000], repeat=1) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        "device: numpy",
        "checks against numpy, bit for bit: 9 codecs, 7 malformed inputs, DLPack, CHOCO with int8, "
        "bf16, randk:0.1: all passed",
    ]
    rows = [line.split() for line in lines[3:]]
    assert [row[0] for row in rows] == list(gpu_codec.TIMED)
    # rates of a 10,000-value vector timed once: on a busy machine one may print as 0.00, so the
    # rows are checked for form, not speed (speeds are the bench's to print, not a test's to judge)
    assert all(
        row[1] == "1e+04" and all(math.isfinite(float(v)) and float(v) >= 0 for v in row[2:]) for row in rows
    ), rows


def test_a_device_that_computes_other_bits_fails_the_checks() -> None:
    def upload(array: np.ndarray) -> np.ndarray:
        """numpy, but one float32 element of a vector is an ulp higher."""
        changed = np.array(array)
        if changed.dtype == np.float32 and changed.size > INT8_BLOCK:
            changed[INT8_BLOCK] = np.nextafter(changed[INT8_BLOCK], np.inf)
        return changed

    failures = gpu_codec.checks(dataclasses.replace(gpu_codec.CPU, upload=upload))
    x = gpu_codec.check_vector()
    n, was, now = x.size, x[INT8_BLOCK], np.nextafter(x[INT8_BLOCK], np.inf)
    differs = f"1 of {n} elements differ, first [{INT8_BLOCK}]: {now} on the device, {was} on the CPU"
    assert failures[:2] == [f"none: frame 0: {differs}", f"none: decoded: {differs}"]
    assert all(f.split(":")[0] in gpu_codec.CHECKED for f in failures), failures  # codecs only
    assert gpu_codec.mismatch("q", np.zeros(2, np.int8), np.zeros(3, np.int8)) == (
        "q is int8[3] on the device, int8[2] on the CPU"
    )


def test_the_choco_check_runs_rounds_that_average_and_keep_the_mean() -> None:
    starts = gpu_codec.choco_starts()
    models = gpu_codec.choco_models(gpu_codec.CPU, "int8")
    assert consensus_distance(models) < 1e-4 < consensus_distance(list(starts))
    np.testing.assert_allclose(np.mean(models, axis=0), starts.mean(axis=0), atol=1e-5)


def test_on_a_gpu_the_device_computes_what_numpy_does() -> None:
    device = cuda_or_reason()
    if isinstance(device, str):
        pytest.skip(f"no GPU here: the device checks need {device}")
    assert gpu_codec.checks(device) == []


def test_without_a_gpu_the_bench_says_what_it_needs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = cuda_or_reason()
    if not isinstance(missing, str):
        pytest.skip("this machine has a GPU: the bench would run in full")
    monkeypatch.setattr(sys, "argv", [gpu_codec.__file__])  # its main here: no second torch import
    assert gpu_codec.main() == 2
    assert capsys.readouterr() == ("", f"bench/gpu_codec.py checks the GPU path and needs {missing}\n")

"""The digits task on wider MLPs, for benchmarks where sending the model is what costs:
``--task wan_task:width_1024`` (64-1024-1024-10, 1.1M parameters, 4.3 MB), ``width_2048``
(4.3M parameters, 17 MB) or ``width_5000`` (25M parameters, 100 MB)."""

from __future__ import annotations

import torch
from torch import nn

from gossipmesh.tasks.digits import DigitsTask


class WideDigits(DigitsTask):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.name = f"digits-{width}"

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        w = self.width
        return nn.Sequential(nn.Linear(64, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))


def width_1024() -> WideDigits:
    return WideDigits(1024)


def width_2048() -> WideDigits:
    return WideDigits(2048)


def width_5000() -> WideDigits:
    return WideDigits(5000)


WIDTHS = (1024, 2048, 5000)

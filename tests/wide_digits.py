"""The digits task on a 17M-parameter MLP (64-4096-4096-10: 68 MB of float32 parameters), for
tests of what a model of that size needs (``--task wide_digits:make_task``)."""

from __future__ import annotations

import torch
from torch import nn

from gossipmesh.tasks.digits import DigitsTask

WIDTH = 4096


class WideDigitsTask(DigitsTask):
    name = "wide_digits"

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
        )


def make_task() -> WideDigitsTask:
    return WideDigitsTask()

"""GossipOptimizer is a torch optimizer: schedulers, GradScaler, clipping, hooks and state dicts
act on it as on the optimizer it wraps."""

from __future__ import annotations

import pytest
import torch

from gossip import Algorithm, GossipOptimizer
from gossipmesh.sim.memory import MemoryNetwork

FEATURES = 4


def _solo(inner: torch.optim.Optimizer, **options: object) -> GossipOptimizer:
    """A node alone in its mesh: every round mixes with no one, so the steps are the local ones."""
    return GossipOptimizer(inner, peer=MemoryNetwork().join("solo"), **options)  # type: ignore[arg-type]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(16, FEATURES, generator=generator)
    return inputs, inputs.sum(1, keepdim=True) + 0.1 * torch.randn(16, 1, generator=generator)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        inputs, targets = _batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def test_it_is_a_torch_optimizer_sharing_the_wrapped_groups_and_state() -> None:
    model = torch.nn.Linear(FEATURES, 1)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    optimizer = _solo(inner)
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert optimizer.param_groups is inner.param_groups and optimizer.state is inner.state
    posts: list[int] = []
    optimizer.register_step_post_hook(lambda *_: posts.append(optimizer.round))
    _train(model, optimizer, range(3))
    assert posts == [1, 2, 3]  # torch's step hooks run, after the step's gossip round
    assert set(inner.state[model.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    with pytest.raises(ValueError, match="averages the parameters it was built with"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})


def test_a_scheduler_sets_the_learning_rate_of_the_local_step() -> None:
    model = torch.nn.Linear(FEATURES, 1, bias=False)
    optimizer = _solo(torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step in range(6):
        model.weight.grad = torch.ones_like(model.weight)
        before = model.weight.detach().clone()
        optimizer.step()
        scheduler.step()
        lr = 0.1 * 0.5 ** (step // 2)
        torch.testing.assert_close(
            before - model.weight.detach(), torch.full_like(before, lr), rtol=1e-5, atol=0
        )
    assert optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


@pytest.mark.parametrize("local_steps", [None, 3], ids=["every-step", "diloco-3"])
def test_a_state_dict_round_trip_midway_continues_exactly(local_steps: int | None) -> None:
    """Ten steps straight, or five, a save, fresh objects loaded from it, and five more: the
    same parameters, Adam moments and counters (with DiLoCo, the outer anchor and momentum)."""
    options = {"average_every": local_steps, "outer_lr": 0.7} if local_steps else {}

    def fresh() -> tuple[torch.nn.Module, GossipOptimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(FEATURES, 1)
        return model, _solo(torch.optim.AdamW(model.parameters(), lr=0.05), **options)

    model, optimizer = fresh()
    _train(model, optimizer, range(10))
    straight = [p.detach().clone() for p in model.parameters()]

    model, optimizer = fresh()
    _train(model, optimizer, range(5))
    saved_model, saved = model.state_dict(), optimizer.state_dict()
    assert saved["gossip"]["steps"] == 5 and ("outer_anchor" in saved["gossip"]) == bool(local_steps)
    model, optimizer = fresh()
    model.load_state_dict(saved_model)
    optimizer.load_state_dict(saved)
    assert (optimizer.step_count, optimizer.round) == (5, 5 // (local_steps or 1))
    assert optimizer.optimizer.state[model.weight]["exp_avg"].abs().sum() > 0
    _train(model, optimizer, range(5, 10))
    for ours, theirs in zip(model.parameters(), straight, strict=True):
        torch.testing.assert_close(ours.detach(), theirs, rtol=0, atol=0)


def test_grad_scaler_steps_it_and_skips_a_step_with_an_overflow() -> None:
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = _solo(torch.optim.SGD(model.parameters(), lr=0.05))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    losses = []
    for step in range(30):
        inputs, targets = _batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(inputs).float(), targets)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        if step == 10:
            model.weight.grad.fill_(float("inf"))  # type: ignore[union-attr]
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    assert optimizer.step_count == 29 and optimizer.round == 29  # the overflowing step skipped
    assert torch.isfinite(model.weight).all() and losses[-1] < 0.2 * losses[0]


def test_options_the_algorithm_cannot_take_fail_before_anything_is_built() -> None:
    model = torch.nn.Linear(FEATURES, 1)
    with pytest.raises(ValueError, match="average_every must be >= 1"):
        _solo(torch.optim.SGD(model.parameters(), lr=0.1), average_every=0)
    assert _solo(torch.optim.SGD(model.parameters(), lr=0.1), algorithm=Algorithm("sgp")).round == 0

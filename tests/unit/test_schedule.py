"""Each adapter's learning rate after k steps equals the cosine-with-warmup formula, in both
stepping modes."""

import math

import pytest
import torch

from marlow.training.optim import AdapterOptimizers, cosine_lr

LR, WARMUP, TOTAL = 1e-3, 3, 10


def make(stepping: str, names=("generator", "aggregator")) -> AdapterOptimizers:
    params = {n: [torch.nn.Parameter(torch.ones(2))] for n in names}
    return AdapterOptimizers(
        params,
        lr=LR,
        warmup=WARMUP,
        total=TOTAL,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        stepping=stepping,
    )


def run_steps(opt: AdapterOptimizers, k: int) -> dict[str, list[float]]:
    """Simulate k training steps; record the lr each adapter's update used."""
    seen: dict[str, list[float]] = {n: [] for n in opt.params}
    for _ in range(k):
        for name, ps in opt.params.items():
            ps[0].grad = torch.ones(2)
            opt.update(name)
            seen[name].append(opt.optimizers[name].param_groups[0]["lr"])
            opt.end_role_update(name)
        opt.end_step()
    return seen


def test_formula_by_hand():
    # warmup: t/W * lr; t = W: full lr; t = W + (S-W)/2: half; t >= S: 0
    assert cosine_lr(1.0, 0, 3, 10) == 0.0
    assert cosine_lr(1.0, 2, 3, 10) == pytest.approx(2 / 3, abs=1e-12)
    assert cosine_lr(1.0, 3, 3, 10) == pytest.approx(1.0, abs=1e-12)
    assert cosine_lr(1.0, 6.5, 3, 10) == pytest.approx(0.5, abs=1e-12)
    assert cosine_lr(1.0, 10, 3, 10) == pytest.approx(0.0, abs=1e-12)
    assert cosine_lr(1.0, 15, 3, 10) == 0.0  # stays at 0 past the end


def test_formula_equals_transformers_up_to_the_end_and_stays_at_0_after():
    from transformers import get_cosine_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=LR)
    hf = get_cosine_schedule_with_warmup(opt, WARMUP, TOTAL)
    hf_lrs = []
    for _ in range(TOTAL + 4):
        hf_lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        hf.step()
    ours = [cosine_lr(LR, t, WARMUP, TOTAL) for t in range(TOTAL + 4)]
    assert ours[: TOTAL + 1] == pytest.approx(hf_lrs[: TOTAL + 1], abs=1e-15)
    assert ours[TOTAL + 1 :] == [0.0] * 3 and min(hf_lrs[TOTAL + 1 :]) > 0  # the departure


def test_per_step_mode_every_adapter_follows_the_step_count():
    seen = run_steps(make("per-step"), 8)
    for name in seen:
        assert seen[name] == pytest.approx(
            [cosine_lr(LR, k, WARMUP, TOTAL) for k in range(8)], abs=1e-15
        )


def test_per_role_update_mode_advances_once_per_role_update():
    opt = make("per-role-update")
    seen = run_steps(opt, 4)
    p = 2  # two adapters: the shared clock moves by 2 per step
    assert seen["generator"] == pytest.approx(
        [cosine_lr(LR, k * p, WARMUP, TOTAL) for k in range(4)], abs=1e-15
    )
    assert seen["aggregator"] == pytest.approx(
        [cosine_lr(LR, k * p + 1, WARMUP, TOTAL) for k in range(4)], abs=1e-15
    )
    assert opt.shared_position == 8


def test_update_returns_pre_clip_norm_and_skips_non_finite():
    opt = make("per-step", names=("a",))
    (param,) = opt.params["a"]
    param.grad = torch.tensor([3.0, 4.0])
    opt.position["a"] = WARMUP  # full lr
    assert opt.update("a") == pytest.approx(5.0)
    before = param.detach().clone()
    param.grad = torch.tensor([math.nan, 1.0])
    assert math.isnan(opt.update("a"))
    assert torch.equal(param.detach(), before)

"""Adam and the learning-rate schedule: Noam warm-up (Sec. 5.3) and the cooldown; both can be
planned from the updates the time budget holds on this machine."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

from .config import TrainConfig
from .model import Transformer

log = logging.getLogger("transformer_mt")


def noam(step: int, d_model: int, warmup: int, factor: float) -> float:
    """lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (Sec. 5.3, Eq. 3)."""
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def noam_ramp(step: int, d_model: int, warmup: int, factor: float, ramp: int) -> float:
    """Noam's rate with `warmup` (Eq. 3), its peak reached in `ramp` <= warmup updates instead: a
    straight rise to the same peak, held until Eq. 3's 1/sqrt(step) decay comes down to it. A
    shorter warm-up (train.warmup_share) changes when the peak comes, not how high it is; ramp ==
    warmup is Eq. 3 itself."""
    peak = noam(warmup, d_model, warmup, factor)
    return min(peak * max(step, 1) / ramp, noam(max(step, warmup), d_model, warmup, factor))


def cooldown_factor(step: int, start: int, end: int, shape: str = "linear") -> float:
    """The learning rate's multiplier for update `step` (1-based): 1 up to `start`, then down to ~0
    at update `end`, the last (end <= start: none). `linear`: a straight line down to
    1 / (end - start); `sqrt`: 1 - sqrt(progress), the progress (step - start - 1) / (end - start)
    going from 0 at the cooldown's first update to (end - start - 1) / (end - start) at its last
    (Hägele et al., 2024)."""
    if end <= start or step <= start:
        return 1.0
    if shape == "sqrt":
        return 1.0 - math.sqrt(min(step - start - 1, end - start) / (end - start))
    return max(end - step + 1, 0) / (end - start)


def cooldown_by_steps(tc: TrainConfig) -> tuple[int, int]:
    """The cooldown's (start, end) updates without a time budget: the last `cooldown` of
    max_steps."""
    if not tc.cooldown:
        return 0, 0
    return tc.max_steps - max(1, round(tc.cooldown * tc.max_steps)), tc.max_steps


def last_update_in_time(tc: TrainConfig, step: int, minutes: float, steps_per_minute: float) -> int:
    """The update at which the time budget ends: the budget's minutes left at this rate (2% kept
    spare), at most max_steps."""
    left = tc.max_minutes - minutes
    return min(tc.max_steps, step + max(1, int(0.98 * steps_per_minute * left)))


def warmup_by_steps(tc: TrainConfig) -> int:
    """The warm-up without a time budget (and, with one, until it is planned): train.warmup, or
    warmup_share of max_steps where that is fewer."""
    if not tc.warmup_share:
        return tc.warmup
    return min(tc.warmup, max(1, round(tc.warmup_share * tc.max_steps)))


def plan_warmup(
    tc: TrainConfig,
    step: int,
    minutes: float,
    steps_per_minute: float,
    agree: Callable[[int], int],
    first: bool = True,
) -> int:
    """The warm-up as warmup_share of the updates the time budget holds at this rate
    (last_update_in_time), at most warmup_by_steps and at least the updates already made; `agree`
    makes every rank take the same (the fewest). Logged at info the first time, at debug when
    re-planned."""
    total = last_update_in_time(tc, step, minutes, steps_per_minute)
    warmup = agree(min(warmup_by_steps(tc), max(step, round(tc.warmup_share * total))))
    log.log(
        logging.INFO if first else logging.DEBUG,
        "warm-up: %d updates, train.warmup_share=%g of the ~%d that train.max_minutes=%g holds "
        "at %.1f updates/min (at most train.warmup=%d; re-planned from the rate so far every "
        "train.log_every updates until it ends)",
        warmup,
        tc.warmup_share,
        total,
        tc.max_minutes,
        steps_per_minute,
        tc.warmup,
    )
    return warmup


def plan_cooldown(
    tc: TrainConfig, step: int, minutes: float, steps_per_minute: float, agree: Callable[[int], int]
) -> tuple[int, int]:
    """The cooldown (start, end) that starts now and ends when the time budget does
    (last_update_in_time); `agree` makes every rank take the same end (the earliest)."""
    end = agree(last_update_in_time(tc, step, minutes, steps_per_minute))
    log.info(
        "cooldown: the learning rate decays %s to ~0 from update %d to %d (%.1f "
        "updates/min, %.1f of train.max_minutes=%g left)",
        "linearly" if tc.cooldown_shape == "linear" else "as 1 - sqrt(progress)",
        step,
        end,
        steps_per_minute,
        tc.max_minutes - minutes,
        tc.max_minutes,
    )
    return step, end


def adam_implementation(device: torch.device) -> dict[str, bool]:
    """Adam's fastest implementation on `device`: fused (one kernel over all parameters) on GPUs
    and CPUs (torch >= 2.4, as pyproject.toml requires), where foreach falls back to small ops per
    parameter (the recipe's 129 tensors: 15 against 5 ms a step with AVX2 kernels;
    docs/multi30k.md); foreach elsewhere."""
    if device.type in ("cuda", "cpu"):
        return {"fused": True, "foreach": False}
    return {"fused": False, "foreach": True}


def build_optimizer(
    model: Transformer,
    tc: TrainConfig,
    device: torch.device,
    cooldown: Callable[[], tuple[int, int]] = lambda: (0, 0),
    warmup: Callable[[], int] | None = None,
) -> tuple[torch.optim.Optimizer, Any]:
    """Adam (adam_implementation's) and the Noam schedule as a LambdaLR, times the cooldown
    factor of the plan that `cooldown()` returns (start, end) when the lr is computed; the peak is
    reached after what `warmup()` returns then (default: train.warmup; noam_ramp)."""
    warmup = warmup or (lambda: tc.warmup)
    params = list(model.parameters())
    groups: list[Any] = params
    if tc.weight_decay and not tc.decay_norms_and_biases:
        matrices = [p for p in params if p.ndim >= 2]  # projections and the embeddings
        vectors = [p for p in params if p.ndim < 2]  # norm gains and biases, linear biases
        groups = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}]
    optimizer = torch.optim.Adam(
        groups,
        lr=1.0,
        betas=tc.adam_betas,
        eps=tc.adam_eps,
        weight_decay=tc.weight_decay,
        decoupled_weight_decay=tc.decoupled_weight_decay,
        **adam_implementation(device),
    )
    # LambdaLR counts from 0 before the first update; update number s uses noam(s).
    d_model = model.cfg.d_model
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda i: (
            noam_ramp(i + 1, d_model, tc.warmup, tc.lr_factor, warmup())
            * cooldown_factor(i + 1, *cooldown(), tc.cooldown_shape)
        ),
    )
    return optimizer, scheduler

"""Setting a training run up: the process (threads, process group, seeds, device), the run
directory with its config, tokenizer and tokenized data, the precision to train in, the module the
loop calls (DDP, torch.compile) and the event log. train.py runs the loop on what this builds."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from .config import Config, TrainConfig, save_config
from .data import TrainingData, prepare_data, prepare_tokenizer
from .distributed import (
    Dist,
    agree_min,
    init_distributed,
    rank_device,
    rank_zero_first,
    seed_everything,
)
from .model import Transformer, label_smoothed_loss
from .runtime import (
    BF16_OUTPUT,
    autocast,
    choose_cpu_precision,
    keep_freed_memory,
    pick_device,
    training_precision,
)
from .tokenizer import Tokenizer

log = logging.getLogger("transformer_mt")


def prepare_run(cfg: Config, run_dir: Path, d: Dist) -> tuple[Tokenizer, TrainingData]:
    """The run directory with its config, the tokenizer and the tokenized data. Rank 0 trains the
    tokenizer and fills the cache; the other ranks then read them."""
    with rank_zero_first(d):
        if d.main:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "config.yaml")
        tokenizer = prepare_tokenizer(cfg, run_dir)
        return tokenizer, prepare_data(cfg, tokenizer)


def training_forward(
    model: Transformer, tc: TrainConfig, d: Dist, device: torch.device
) -> torch.nn.Module:
    """The module the loop calls: DDP and/or torch.compile around the model. Checkpoints take the
    state dict of the plain model, so they load without either."""
    forward: torch.nn.Module = model
    if d.world > 1:
        forward = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if tc.compile:
        forward = torch.compile(forward, dynamic=True)
    return forward


def init_runtime(tc: TrainConfig) -> tuple[Dist, torch.device]:
    """Threads, the process group, seeds (seed + rank: each rank its own dropout masks); this
    process's device."""
    if tc.threads:
        torch.set_num_threads(tc.threads)
    d = init_distributed(tc.device)
    seed_everything(tc.seed, d.rank)
    device = rank_device(d, pick_device(tc.device))
    if device.type == "cpu" and keep_freed_memory():
        log.debug("malloc keeps freed memory: no page faults for each step's large tensors")
    return d, device


def cpu_probe_step(
    model: Transformer, tc: TrainConfig, device: torch.device
) -> Callable[[str], None]:
    """A training step of `model` in a given precision on a synthetic batch of train.max_tokens (at
    most 4,096), for runtime.choose_cpu_precision: how much the output layer weighs depends on the
    batch size. It changes no weight, and leaves no gradient and the output layer in fp32."""
    T = 24
    n = max(1, min(tc.max_tokens, 4096) // T) * T
    # Ids within each side's own vocabulary (a separate target vocabulary may be smaller than the
    # source's), above the special ids. (B, T)
    src = (torch.arange(n) % (model.src_embed.lut.num_embeddings - 4) + 4).view(-1, T).to(device)
    # (B, T)
    tgt = (torch.arange(n) % (model.generator.out_features - 4) + 4).view(-1, T).to(device)

    def step(precision: str) -> None:
        model.output_dtype = torch.bfloat16 if precision == BF16_OUTPUT else None
        with autocast(precision, device):
            logits = model(src, tgt)  # (B, T, V)
        label_smoothed_loss(logits, tgt, tc.label_smoothing).backward()
        model.zero_grad(set_to_none=True)
        model.output_dtype = None

    return step


def set_up_precision(
    model: Transformer,
    tc: TrainConfig,
    d: Dist,
    device: torch.device,
    resumed: dict[str, Any] | None,
) -> str:
    """The precision to train in (runtime.training_precision: auto on a CPU times this model's
    step, all ranks taking the most exact choice; a resumed run keeps its own); bf16-output puts
    the model's output projection in bf16."""
    precision = training_precision(
        tc.precision,
        device,
        resumed["train_state"].get("precision", "") if resumed is not None else "",
        lambda: choose_cpu_precision(
            cpu_probe_step(model, tc, device), lambda mine: agree_min(d, device, mine)
        ),
    )
    model.output_dtype = torch.bfloat16 if precision == BF16_OUTPUT else None
    return precision


def describe_run(
    tc: TrainConfig,
    d: Dist,
    device: torch.device,
    precision: str,
    model: Transformer,
    data: TrainingData,
    batches_per_epoch: int,
) -> None:
    """One log line on what is about to be trained, and how."""
    log.info(
        "device %s, precision %s, %.2fM parameters, %d training pairs, %d batches/epoch of <= %d "
        "tokens; effective batch <= %d tokens (max_tokens %d x accumulate %d x %d process%s)",
        device,
        precision,
        model.num_parameters() / 1e6,
        len(data.train_idx),
        batches_per_epoch,
        tc.max_tokens,
        tc.max_tokens * tc.accumulate * d.world,
        tc.max_tokens,
        tc.accumulate,
        d.world,
        "es" if d.world > 1 else "",
    )


def open_event_log(run_dir: Path, d: Dist) -> Any:
    """TensorBoard's SummaryWriter into run_dir/tb on rank 0; a stand-in that writes nothing on
    the other ranks."""
    if not d.main:
        return NullWriter()
    from torch.utils.tensorboard import SummaryWriter  # imported late: slow, only training needs it

    return SummaryWriter(str(run_dir / "tb"))


class NullWriter:
    """Stands in for the SummaryWriter on ranks other than 0."""

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, done: int, main: bool) -> tqdm:
    """The training loop's bar, in updates: on rank 0, unless `tmt -q` quieted the logger."""
    return tqdm(
        total=total,
        initial=done,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        disable=not main or log.level > logging.INFO,
    )

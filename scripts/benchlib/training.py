"""Training steps for the benchmarks, from the package's public pieces: a config's tokenized data,
its batches, and one optimizer update as the training loop makes it (the speed bench and the
allocator bench time these)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from transformer_mt.config import Config, TrainConfig
from transformer_mt.data import (
    Batch,
    TrainingData,
    collate,
    make_batches,
    prepare_data,
    prepare_tokenizer,
)
from transformer_mt.model import Dropout, Transformer
from transformer_mt.optim import build_optimizer
from transformer_mt.prepare import chunked_loss, training_loss
from transformer_mt.runtime import BF16_OUTPUT, attention_kernel, autocast
from transformer_mt.tokenizer import Tokenizer

Step = Callable[[Batch], torch.Tensor]


@dataclass
class BenchData:
    """A config's tokenizer and tokenized training data."""

    tokenizer: Tokenizer
    data: TrainingData

    @classmethod
    def load(cls, cfg: Config, tokenizer: Tokenizer | None = None) -> BenchData:
        """The run's tokenizer (trained into output_dir if it has none) or the one given, and the
        train split tokenized once (then memory-mapped from the cache)."""
        tokenizer = tokenizer or prepare_tokenizer(cfg, _run_dir(cfg))
        return cls(tokenizer, prepare_data(cfg, tokenizer))

    def batches(
        self, max_tokens: int, *, seed: int, epoch: int = 1, limit: int | None = None
    ) -> list[Batch]:
        """The first `limit` (default: all) of one epoch's training batches of at most
        `max_tokens` tokens, collated: the batches the training loop would take (without subword
        sampling or bidirectional training)."""
        idx, train = self.data.train_idx, self.data.train
        order = make_batches(
            train.src_lens[idx], train.tgt_lens[idx], max_tokens, seed=seed, epoch=epoch
        )
        return [collate(train, idx[b]) for b in order[:limit]]

    def model(self, cfg: Config, seed: int) -> Transformer:
        """A fresh model of the config's sizes for this tokenizer, initialised from `seed`."""
        torch.manual_seed(seed)
        return Transformer(cfg.model, *self.tokenizer.sizes())


def _run_dir(cfg: Config) -> Path:
    run = Path(cfg.output_dir)
    run.mkdir(parents=True, exist_ok=True)
    return run


def training_step(
    model: Transformer, tc: TrainConfig, precision: str, attention: str = "fused"
) -> Step:
    """One optimizer update per batch on the CPU, as the training loop makes it: Adam and the Noam
    schedule (optim.build_optimizer), the label-smoothed loss over the batch's target tokens, in
    `precision` (fp32, bf16 autocast, or bf16-output: fp32 with the output projection in bf16),
    attending with the `attention` kernel (runtime.ATTENTION_KERNELS; prepare.set_up_attention
    resolves train.attention as the loop does)."""
    device = torch.device("cpu")
    model.output_dtype = torch.bfloat16 if precision == BF16_OUTPUT else None
    model.train()
    optimizer, scheduler = build_optimizer(model, tc, device)
    chunked = chunked_loss(tc, device)

    def step(batch: Batch) -> torch.Tensor:
        with autocast(precision, device), attention_kernel(attention):
            loss = training_loss(
                model, batch.src, batch.tgt_in, batch.tgt_out, tc.label_smoothing, chunked
            )
        (loss / batch.n_tgt_tokens).backward()
        if tc.clip_norm > 0:
            nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return loss.detach()

    return step


def with_torch_dropout(model: nn.Module) -> nn.Module:
    """The model with each of our Dropout modules (a mask from four random bytes per draw) replaced
    by torch's nn.Dropout (F.dropout: one draw per element), to show what ours is worth."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Dropout):
            model.set_submodule(name, nn.Dropout(module.p))
    return model


def window_speeds(
    contenders: dict[str, Step], batches: Sequence[Batch], warmup: int, window: int = 10
) -> dict[str, list[float]]:
    """Target tokens/s of each contender over the same windows of `window` batches after `warmup`
    untimed ones, the contenders taking turns window by window: a slow spell on a shared machine
    then hits all of them, not one. The loss stays on the device (no host sync inside a window)."""
    for step in contenders.values():
        for b in batches[:warmup]:
            step(b)
    speeds: dict[str, list[float]] = {name: [] for name in contenders}
    timed = batches[warmup:]
    for i in range(0, len(timed) - window + 1, window):
        chunk = timed[i : i + window]
        tokens = sum(b.n_tgt_tokens for b in chunk)
        for name, step in contenders.items():
            t0 = time.perf_counter()
            for b in chunk:
                step(b)
            speeds[name].append(tokens / (time.perf_counter() - t0))
    return speeds

"""The training loop: Adam + Noam schedule, label-smoothed cross-entropy, validation, checkpoints.

The loop's whole state is one `TrainState` saved in every checkpoint, and the batch order is a
pure function of (seed, epoch): resuming mid-epoch, or sharding batches across data-parallel
ranks, is a matter of skipping or striding through that list. Set-up is plain functions; the
checkpoint format is checkpoint.py's, the process group distributed.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .checkpoint import (
    CheckpointError,
    average_checkpoints,
    copy_checkpoint,
    load_training_checkpoint,
    restore_training,
    save_checkpoint,
    save_rotating,
    step_checkpoints,
    step_of,
    training_checkpoint,
    validation_score,
)
from .config import Config, DecodeConfig, TrainConfig, save_config
from .data import (
    Batch,
    DataError,
    TokenizedCorpus,
    cache_dir,
    collate,
    iter_split,
    load_tokenized,
    make_batches,
    read_split,
    usable_indices,
)
from .distributed import (
    Dist,
    agree,
    agree_min,
    gathered_rng,
    global_sum,
    init_distributed,
    leave_distributed,
    rank_device,
    rank_zero_first,
    restore_rng,
    seed_everything,
)
from .errors import UserError
from .metrics import score
from .model import Transformer
from .runtime import (
    BF16_OUTPUT,
    autocast,
    compute_dtype,
    fastest_cpu_precision,
    inference_model,
    keep_freed_memory,
    matmul_gflops,
    pick_device,
    resolve_precision,
)
from .search import translate_ids
from .tokenizer import Tokenizer, train_tokenizer
from .vocab import PAD

log = logging.getLogger("transformer_mt")


def noam(step: int, d_model: int, warmup: int, factor: float) -> float:
    """lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (Sec. 5.3, Eq. 3)."""
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def cooldown_factor(step: int, start: int, end: int) -> float:
    """The learning rate's multiplier for update `step` (1-based): 1 up to `start`, then a straight
    line down to 1 / (end - start) at update `end`, the last (annealing to ~0 by the end of the run;
    end <= start: none)."""
    if end <= start or step <= start:
        return 1.0
    return max(end - step + 1, 0) / (end - start)


def label_smoothed_loss(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float
) -> torch.Tensor:
    """Summed label-smoothed cross-entropy over non-padding targets (Sec. 5.4). logits (..., V)."""
    V = logits.size(-1)
    return F.cross_entropy(
        logits.reshape(-1, V).float(),
        target.reshape(-1),
        ignore_index=PAD,
        label_smoothing=smoothing,
        reduction="sum",
    )


@dataclass
class TrainState:
    """Everything the loop needs to continue exactly where it stopped."""

    step: int = 0  # optimizer updates done
    epoch: int = 1
    batch_in_epoch: int = 0  # batches of this epoch already consumed
    target_tokens: int = 0  # non-pad target tokens trained on
    best_score: float = -math.inf  # validation BLEU (or -loss without BLEU)
    best_step: int = 0
    bad_validations: int = 0  # validations since the best one
    seconds: float = 0.0  # training wall-clock of earlier (resumed-from) runs
    precision: str = ""  # what the run trains in (precision auto's measured choice)
    # the lr decays linearly from update cooldown_start to ~0 at cooldown_end
    cooldown_start: int = 0
    cooldown_end: int = 0  # (both 0: no cooldown); see cooldown_by_steps and plan_cooldown

    def cooldown(self) -> tuple[int, int]:
        """The cooldown plan (start, end) that the schedule reads at every update, after a resume
        too."""
        return self.cooldown_start, self.cooldown_end

    def summary(self, reason: str, minutes: float, run_dir: Path, rank: int) -> dict[str, Any]:
        """What `train` returns: how far the run got, why it stopped, its best validation."""
        return {
            "steps": self.step,
            "epochs": self.epoch,
            "minutes": round(minutes, 2),
            "best_score": self.best_score,
            "best_step": self.best_step,
            "target_tokens": self.target_tokens,
            "stopped": reason,
            "run_dir": str(run_dir),
            "rank": rank,
        }

    def record_validation(self, score: float | None) -> bool:
        """Note this step's validation score; True if it is the best so far (always, with nothing to
        score)."""
        improved = score is None or score > self.best_score
        if improved:
            self.best_score = self.step if score is None else score
            self.best_step, self.bad_validations = self.step, 0
        else:
            self.bad_validations += 1
        return improved


# --------------------------------------------------------------------------- set-up


def resume_path(run_dir: Path, resume: str | Path | bool | None) -> Path | None:
    """The checkpoint to resume from; refuses to start over a run that has checkpoints."""
    last = run_dir / "checkpoints" / "last.pt"
    if resume is None or resume is False:
        if last.exists():
            raise UserError(
                f"{run_dir} already holds a run (checkpoints/last.pt): add --resume to "
                "continue it, or set another output_dir (or delete the folder) to start over"
            )
        return None
    path = last if resume is True else Path(resume)
    if not path.is_file():
        raise CheckpointError(f"cannot resume: checkpoint not found: {path}")
    return path


def prepare_tokenizer(cfg: Config, run_dir: Path) -> Tokenizer:
    """Reuse the run's SentencePiece model if there is one; otherwise train it on the train
    split."""
    if Tokenizer.exists(run_dir):
        return Tokenizer.load(run_dir)
    log.info(
        "training SentencePiece (%s, %d pieces, %s) on the training split",
        cfg.tokenizer.type,
        cfg.tokenizer.vocab_size,
        "joint" if cfg.tokenizer.joint else "separate",
    )
    pairs = lambda: iter_split(cfg.data, "train")  # noqa: E731  streamed, twice
    if next(pairs(), None) is None:
        raise DataError("data.train: the corpus is empty")
    tok = train_tokenizer(
        cfg.tokenizer, (s for s, _ in pairs()), (t for _, t in pairs()), seed=cfg.train.seed
    )
    tok.save(run_dir)
    return tok


@dataclass
class TrainingData:
    """The tokenized splits and the pairs of each that the loop uses."""

    train: TokenizedCorpus
    train_idx: np.ndarray
    valid: TokenizedCorpus | None = None
    valid_idx: np.ndarray | None = None


def prepare_data(cfg: Config, tokenizer: Tokenizer) -> TrainingData:
    """Tokenize (or memory-map from the cache) the train and valid splits; drop unusable pairs."""
    cache = cache_dir(cfg.data)
    train = load_tokenized(cfg.data, "train", tokenizer, cache)
    data = TrainingData(train, usable_indices(train, cfg.data.max_len, "train"))
    if cfg.data.valid is not None:
        data.valid = load_tokenized(cfg.data, "valid", tokenizer, cache)
        data.valid_idx = usable_indices(data.valid, cfg.model.max_positions - 1, "valid")
    return data


def prepare_run(cfg: Config, run_dir: Path, d: Dist) -> tuple[Tokenizer, TrainingData]:
    """The run directory with its config, the tokenizer and the tokenized data. Rank 0 trains the
    tokenizer and fills the cache; the other ranks then read them."""
    with rank_zero_first(d):
        if d.main:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "config.yaml")
        tokenizer = prepare_tokenizer(cfg, run_dir)
        return tokenizer, prepare_data(cfg, tokenizer)


def build_optimizer(
    model: Transformer,
    tc: TrainConfig,
    device: torch.device,
    cooldown: Callable[[], tuple[int, int]] = lambda: (0, 0),
) -> tuple[torch.optim.Optimizer, Any]:
    """Adam (fused on GPUs, foreach elsewhere) and the Noam schedule as a LambdaLR, times the
    cooldown factor of the plan that `cooldown()` returns (start, end) when the lr is computed."""
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.Adam(
        model.parameters(),
        lr=1.0,
        betas=tc.adam_betas,
        eps=tc.adam_eps,
        weight_decay=tc.weight_decay,
        **fused,
    )
    # LambdaLR counts from 0 before the first update; update number s uses noam(s).
    d_model = model.cfg.d_model
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda i: (
            noam(i + 1, d_model, tc.warmup, tc.lr_factor) * cooldown_factor(i + 1, *cooldown())
        ),
    )
    return optimizer, scheduler


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
        "tokens; "
        "effective batch <= %d tokens (max_tokens %d x accumulate %d x %d process%s)",
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


def init_runtime(tc: TrainConfig) -> tuple[Dist, torch.device, str]:
    """Threads, the process group, seeds (seed + rank: each rank its own dropout masks); this
    process's device and the resolved precision."""
    if tc.threads:
        torch.set_num_threads(tc.threads)
    d = init_distributed(tc.device)
    seed_everything(tc.seed, d.rank)
    device = rank_device(d, pick_device(tc.device))
    if device.type == "cpu" and keep_freed_memory():
        log.debug("malloc keeps freed memory: no page faults for each step's large tensors")
    return d, device, resolve_precision(tc.precision, device)


# From the most exact to the least: ranks that measured differently train in the most exact of their
# choices.
CPU_PRECISIONS = ("fp32", BF16_OUTPUT, "bf16")


def choose_cpu_precision(model: Transformer, tc: TrainConfig, d: Dist, device: torch.device) -> str:
    """precision auto on a CPU: time a training step of this model on a synthetic batch of
    train.max_tokens (at most 4,096) in fp32, in bf16 autocast and in fp32 with a bf16 output layer,
    and train in the fastest, but in fp32 unless that is at least 10% faster (fp32 is exact, so it
    wins near-ties and the choice does not flip on timing noise). A batch of the run's size: how
    much the output layer weighs depends on it. bf16 candidates are not timed where the CPU emulates
    bf16, nor further where their first step is slow."""
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

    fastest, seconds, skipped = fastest_cpu_precision(step, candidates=CPU_PRECISIONS)
    model.output_dtype = None
    mine = fastest if seconds and seconds[fastest] < 0.9 * seconds["fp32"] else "fp32"
    choice = CPU_PRECISIONS[agree_min(d, device, CPU_PRECISIONS.index(mine))]
    timed = ", ".join(f"{1000 * s:.0f} ms in {p}" for p, s in seconds.items())
    log.info(
        "precision auto: %s%s; training in %s",
        f"a training step took {timed} on this CPU" if timed else "nothing timed",
        "".join(f"; {p} skipped ({why})" for p, why in skipped.items()),
        choice,
    )
    return choice


def set_up_precision(
    model: Transformer,
    tc: TrainConfig,
    d: Dist,
    device: torch.device,
    precision: str,
    resumed_ckpt: dict[str, Any] | None = None,
) -> str:
    """The precision to train in (auto on a CPU: measured, bf16 only where the CPU has it; a resumed
    auto run keeps the one it began in, so one run never mixes two); bf16-output sets the model's
    output projection to bf16."""
    resumed = resumed_ckpt["train_state"].get("precision", "") if resumed_ckpt is not None else ""
    if tc.precision == "auto" and resumed:
        precision = resumed
        log.info("precision auto: %s, as the run being resumed trained in", precision)
    elif tc.precision == "auto" and device.type == "cpu":
        precision = choose_cpu_precision(model, tc, d, device)
    model.output_dtype = torch.bfloat16 if precision == BF16_OUTPUT else None
    return precision


def cooldown_by_steps(tc: TrainConfig) -> tuple[int, int]:
    """The cooldown's (start, end) updates without a time budget: the last `cooldown` of
    max_steps."""
    if not tc.cooldown:
        return 0, 0
    return tc.max_steps - max(1, round(tc.cooldown * tc.max_steps)), tc.max_steps


def plan_cooldown(
    state: TrainState,
    tc: TrainConfig,
    d: Dist,
    device: torch.device,
    minutes: float,
    steps_per_minute: float,
) -> int:
    """Start the cooldown now, to end when the time budget does: the updates left are the budget's
    minutes left at this run's rate (2% kept spare), at most max_steps. Every rank takes the same
    plan; returns its end."""
    left = tc.max_minutes - minutes
    end = min(tc.max_steps, state.step + max(1, int(0.98 * steps_per_minute * left)))
    state.cooldown_start, state.cooldown_end = state.step, agree_min(d, device, end)
    log.info(
        "cooldown: the learning rate decays linearly to ~0 from update %d to %d (%.1f updates/min, "
        "%.1f of "
        "train.max_minutes=%g left)",
        state.step,
        state.cooldown_end,
        steps_per_minute,
        left,
        tc.max_minutes,
    )
    return state.cooldown_end


def stopped_already(tc: TrainConfig, state: TrainState, batches: EpochBatches) -> str:
    """Why a resumed run has nothing left to train ("" if it has): a limit it had reached when it
    was saved. A run saved after its last epoch's last batch still counts that epoch (the stream
    moves on only when asked)."""
    if state.step >= tc.max_steps:
        return f"train.max_steps={tc.max_steps} reached"
    if state.step >= state.cooldown_end > 0:
        return f"the cooldown's last update (train.cooldown={tc.cooldown:g}) done"
    last_done = (
        state.epoch == tc.max_epochs
        and state.batch_in_epoch >= len(batches.epoch(state.epoch)) // batches.dist.world
    )
    if state.epoch > tc.max_epochs or last_done:
        return f"train.max_epochs={tc.max_epochs} reached"
    if tc.max_minutes and state.seconds >= 60 * tc.max_minutes:
        return f"train.max_minutes={tc.max_minutes:g} reached"
    return ""


# --------------------------------------------------------------------------- loop helpers


class Meter:
    """Loss, target tokens and FLOPs of the steps since the last log line; the loss stays on the
    device."""

    def __init__(self, device: torch.device, first_step: int, peak_gflops: float):
        self.loss, self.peak_gflops = torch.zeros((), device=device), peak_gflops
        self.reset(first_step)

    def reset(self, first_step: int) -> None:
        self.loss.zero_()
        self.tokens, self.flops, self.start, self.first_step = (
            0,
            0.0,
            time.perf_counter(),
            first_step,
        )

    def add(self, loss: torch.Tensor, tokens: int, flops: float) -> None:
        self.loss += loss
        self.tokens += tokens
        self.flops += flops

    def log(self, step: int, loss: float, lr: float, bar: tqdm, writer: Any, **extra: str) -> None:
        """Show loss, lr, tokens/s and MFU on the bar and in the event log; start the next
        window."""
        seconds = max(time.perf_counter() - self.start, 1e-9)
        # MFU per device
        tok_s, mfu = self.tokens / seconds, self.flops / seconds / 1e9 / self.peak_gflops
        bar.set_postfix(
            loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", mfu=f"{mfu:.0%}", **extra
        )
        for name, value in (("loss", loss), ("lr", lr), ("tokens_per_sec", tok_s), ("mfu", mfu)):
            writer.add_scalar(f"train/{name}", value, step)
        self.reset(step + 1)


class StopSignals:
    """SIGINT/SIGTERM ask the loop to finish its step and write last.pt (`caught` names the signal);
    a second one stops at once. Outside the main thread (no signals there) it does nothing."""

    def __init__(self) -> None:
        self.caught: str | None = None
        self.previous: dict[int, Any] = {}

    def handler(self, signum: int, frame: Any) -> None:
        if self.caught is not None:
            raise KeyboardInterrupt
        self.caught = signal.Signals(signum).name
        tqdm.write(
            f"tmt: {self.caught}: finishing this step and writing last.pt (press Ctrl-C again to "
            "stop at once)"
        )

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self.previous = {
                sig: signal.signal(sig, self.handler) for sig in (signal.SIGINT, signal.SIGTERM)
            }
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, h in self.previous.items():
            signal.signal(sig, h)


class EpochBatches:
    """The training batches of each epoch, and this rank's share of them from any point on."""

    def __init__(self, data: TrainingData, tc: TrainConfig, d: Dist):
        self.data, self.tc, self.dist = data, tc, d

    def epoch(self, epoch: int) -> list[np.ndarray]:
        """All ranks' batches of one epoch (indices into the training corpus), cut to a multiple of
        the world size; rank r takes batches r, r + world, r + 2*world, ..."""
        idx, world = self.data.train_idx, self.dist.world
        batches = make_batches(
            self.data.train.src_lens[idx],
            self.data.train.tgt_lens[idx],
            self.tc.max_tokens,
            seed=self.tc.seed,
            epoch=epoch,
        )
        return [idx[b] for b in batches[: len(batches) // world * world]]

    def stream(self, state: TrainState) -> Iterator[tuple[Batch, int]]:
        """Endless stream of (this rank's batch, target tokens of that batch summed over all ranks)
        from the state's position, which it advances (batch_in_epoch counts this rank's batches)."""
        tgt_lens, world = self.data.train.tgt_lens, self.dist.world
        while state.epoch <= self.tc.max_epochs:
            batches = self.epoch(state.epoch)
            while state.batch_in_epoch < len(batches) // world:
                j = state.batch_in_epoch * world
                group = batches[j : j + world]  # this step's batches of every rank
                state.batch_in_epoch += 1
                yield (
                    collate(self.data.train, group[self.dist.rank]),
                    sum(int(tgt_lens[b].sum()) + len(b) for b in group),
                )
            state.epoch += 1
            state.batch_in_epoch = 0


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """Builds data, tokenizer, model and optimizer from a Config and runs the loop."""

    def __init__(self, cfg: Config, resume: str | Path | bool | None = None):
        self.started = time.perf_counter()
        self.cfg, self.run_dir, tc = cfg, Path(cfg.output_dir), cfg.train
        resume_from = resume_path(self.run_dir, resume)
        self.dist, self.device, self.precision = init_runtime(tc)
        resumed = (
            load_training_checkpoint(resume_from, map_location=self.device)
            if resume_from is not None
            else None
        )
        self.tokenizer, self.data = prepare_run(cfg, self.run_dir, self.dist)
        self.batches = EpochBatches(self.data, tc, self.dist)
        bleu = self.data.valid is not None and tc.valid_bleu and self.dist.main  # rank 0 validates
        # BLEU scores the raw references
        self.valid_refs = read_split(cfg.data, "valid")[1] if bleu else None
        self.model = Transformer(cfg.model, *self.tokenizer.sizes()).to(self.device)
        self.precision = set_up_precision(
            self.model, tc, self.dist, self.device, self.precision, resumed
        )
        self.forward = training_forward(self.model, tc, self.dist, self.device)
        # the event writer opens when training starts
        self.state, self.writer = TrainState(), _NullWriter()
        self.optimizer, self.scheduler = build_optimizer(
            self.model, tc, self.device, lambda: self.state.cooldown()
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        if resumed is not None:
            self._restore(resume_from, resumed)

    def _restore(self, path: Path, ckpt: dict[str, Any]) -> None:
        """Model, optimizer, schedule, scaler, loop position and every RNG, as they were when
        saved."""
        restore_training(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            cfg=self.cfg,
            tokenizer=self.tokenizer,
            run_dir=self.run_dir,
            device=self.device,
            ckpt=ckpt,
        )
        self.state = TrainState(**ckpt["train_state"])
        if not restore_rng(self.dist, ckpt["rng"]):
            log.warning(
                "resuming with %d processes from another number: random streams will differ",
                self.dist.world,
            )
        log.info(
            "resumed from %s: step %d, epoch %d, batch %d of the epoch",
            path,
            self.state.step,
            self.state.epoch,
            self.state.batch_in_epoch,
        )

    def train(self) -> dict[str, Any]:
        """Run until max_steps, max_epochs, the time budget or early stopping, and return a summary;
        a resumed run that had stopped there trains and writes nothing. DDP ranks agree at log and
        validation steps only."""
        done = stopped_already(self.cfg.train, self.state, self.batches)
        if done:
            log.info(
                "nothing to train: %s when the resumed checkpoint was written; its checkpoints are "
                "left as "
                "they are",
                done,
            )
            return self.state.summary(done, self.minutes(), self.run_dir, self.dist.rank)
        try:
            return self._train()
        finally:
            self.writer.close()  # flushed and closed on every way out: NaN, signals, errors

    def _train(self) -> dict[str, Any]:
        tc = self.cfg.train
        bar, peak = self._start()
        batches, meter = (
            self.batches.stream(self.state),
            Meter(self.device, self.state.step + 1, peak),
        )
        validated_at, reason = -1, ""
        self.model.train()
        # this process's step rate, for the plan
        first_step, first_minute = self.state.step, self.minutes()
        with StopSignals() as signals:
            while not reason:
                pairs = list(itertools.islice(batches, tc.accumulate))
                if not pairs:
                    reason = f"train.max_epochs={tc.max_epochs} reached"
                    break
                micro, tokens = [b for b, _ in pairs], sum(n for _, n in pairs)
                # host tensors: no sync
                flops = sum(self.model.train_flops(b.src, b.tgt_out) for b in micro)
                meter.add(self.train_step(micro, tokens), tokens, flops)
                self.state.step += 1
                self.state.target_tokens += tokens
                bar.update(1)
                step = self.state.step
                now, budget = self.minutes(), tc.max_minutes or math.inf
                cooling_due = step < self.state.cooldown_start and now >= (1 - tc.cooldown) * budget
                due = self.dist.world == 1 or step % tc.log_every == 0 or step % tc.valid_every == 0
                out_of_time, interrupted, cool = (
                    agree(
                        self.dist,
                        self.device,
                        now >= budget,
                        signals.caught is not None,
                        cooling_due,
                    )
                    if due
                    else (False, False, False)
                )
                # the time budget will end the run before max_steps: cool down over its last part
                if cool:
                    rate = (step - first_step) / max(now - first_minute, 1e-9)
                    bar.total = plan_cooldown(self.state, tc, self.dist, self.device, now, rate)
                if step >= tc.max_steps:
                    reason = f"train.max_steps={tc.max_steps} reached"
                elif step >= self.state.cooldown_end > 0:
                    reason = f"the cooldown's last update (train.cooldown={tc.cooldown:g}) done"
                elif out_of_time:
                    reason = f"train.max_minutes={tc.max_minutes:g} reached"
                if step % tc.log_every == 0 or step % tc.valid_every == 0 or reason or interrupted:
                    self._report(meter, bar, logged=step % tc.log_every == 0)
                if interrupted and not reason:
                    self._stop_interrupted(bar, signals.caught)
                if step % tc.valid_every == 0 or reason:
                    validated_at = step
                    if self.validate_and_save(bar) and not reason:
                        reason = f"no better validation score in train.patience={tc.patience} validations"
                elif tc.save_every and step % tc.save_every == 0:
                    # not validated: it carries no metrics, so `average --best` does not rank it
                    self.save({})
        if validated_at != self.state.step:
            self.validate_and_save(bar)  # keep the final weights too
        bar.close()
        return self._finish(reason)

    def _start(self) -> tuple[tqdm, float]:
        """Open the event log (rank 0), say what is trained; the progress bar and the matmul
        GFLOP/s."""
        tc, main, self.state.precision = self.cfg.train, self.dist.main, self.precision
        if not self.state.cooldown_end:  # by steps; the time budget may move it earlier
            self.state.cooldown_start, self.state.cooldown_end = cooldown_by_steps(tc)
        if main:
            # imported late: slow, and only the loop needs it
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tb"))
            describe_run(
                tc,
                self.dist,
                self.device,
                self.precision,
                self.model,
                self.data,
                len(self.batches.epoch(1)),
            )
        m = self.cfg.model
        bar = tqdm(
            total=self.state.cooldown_end or tc.max_steps,
            initial=self.state.step,
            desc="train",
            unit="step",
            # tmt -q
            dynamic_ncols=True,
            mininterval=1.0,
            disable=not main or log.level > logging.INFO,
        )
        return bar, matmul_gflops(
            self.device, compute_dtype(self.precision), 4096, m.d_model, m.d_ff
        )

    def _report(self, meter: Meter, bar: tqdm, logged: bool) -> None:
        """Stop on a non-finite loss; on log steps, show and record loss, lr, tokens/s and MFU."""
        step, tc = self.state.step, self.cfg.train
        # the one host sync per window
        loss = global_sum(self.dist, meter.loss) / max(meter.tokens, 1)
        if not math.isfinite(loss):
            bar.close()
            raise TrainingDiverged.at(
                loss, meter.first_step, step, self.run_dir / "checkpoints" / "last.pt"
            )
        if logged:
            budget = {"min": f"{self.minutes():.1f}/{tc.max_minutes:g}"} if tc.max_minutes else {}
            meter.log(step, loss, self.scheduler.get_last_lr()[0], bar, self.writer, **budget)

    def _stop_interrupted(self, bar: tqdm, signal_name: str | None) -> None:
        """After a signal: write last.pt (every rank gives its RNG state; rank 0 writes) and
        stop."""
        bar.close()
        rng = gathered_rng(self.dist)
        last = self.run_dir / "checkpoints" / "last.pt"
        if self.dist.main:
            save_checkpoint(last, self._checkpoint({}, rng))
        raise TrainingInterrupted(
            f"{signal_name or 'signal'}: stopped after step {self.state.step}, saved {last}; "
            "continue with the same command plus --resume",
            143 if signal_name == "SIGTERM" else 130,
        )

    def _finish(self, reason: str) -> dict[str, Any]:
        if self.dist.main:
            log.info("stopped: %s", reason)
            if self.cfg.train.average_last > 1:
                average_and_validate(
                    self.run_dir,
                    self.cfg.train.average_last,
                    self.model,
                    self.validation_metrics,
                    self.state.best_score,
                )
        self.writer.close()
        return self.state.summary(reason, self.minutes(), self.run_dir, self.dist.rank)

    def minutes(self) -> float:
        """Training wall-clock so far (set-up included), summed over resumed runs."""
        return (self.state.seconds + time.perf_counter() - self.started) / 60

    def train_step(self, micro: list[Batch], global_tokens: int | None = None) -> torch.Tensor:
        """One optimizer update over `micro` batches; returns the summed loss (a device tensor). The
        loss is normalised by the update's target tokens over all ranks, known on the host (no
        sync); DDP averages gradients over ranks, so each rank scales its share by the world
        size."""
        tc, world = self.cfg.train, self.dist.world
        n_tokens = global_tokens or sum(b.n_tgt_tokens for b in micro)
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro):
            batch = batch.to(self.device)
            # under torch.compile, the wrapped DDP module
            ddp = getattr(self.forward, "_orig_mod", self.forward)
            last = i == len(micro) - 1
            # micro-steps skip all-reduce
            with contextlib.nullcontext() if last or world == 1 else ddp.no_sync():
                with autocast(self.precision, self.device):
                    logits = self.forward(batch.src, batch.tgt_in)  # (B, T, V)
                loss = label_smoothed_loss(logits, batch.tgt_out, tc.label_smoothing)
                self.scaler.scale(loss * (world / n_tokens)).backward()
            total += loss.detach()
        if tc.clip_norm > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.clip_norm)
        # skipped when the scaled gradients hold an inf or NaN (fp16)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total

    # ------------------------------------------------------------------ validation and checkpoints

    def validation_metrics(self) -> dict[str, float]:
        return validate(
            self.model,
            self.data,
            self.valid_refs,
            self.tokenizer,
            self.cfg,
            self.precision,
            self.device,
        )

    def validate_and_save(self, bar: tqdm | None = None) -> bool:
        """Validate, write checkpoints (last, step_N, best), and say whether to stop early. Under
        DDP rank 0 does this while the others wait; every rank learns the early-stop decision."""
        rng = gathered_rng(self.dist)
        stop = False
        if self.dist.main:
            step, metrics = self.state.step, self.validation_metrics()
            for k, v in metrics.items():
                self.writer.add_scalar(f"valid/{k}", v, step)
            improved = self.state.record_validation(validation_score(metrics))
            self.save(metrics, best=improved, rng=rng)
            msg = " ".join(f"{k} {v:.2f}" for k, v in metrics.items()) or "(no validation set)"
            (bar.write if bar and not bar.disable else log.info)(
                f"step {step}: valid {msg}{' (best)' if improved else ''}"
            )
            stop = (
                bool(self.cfg.train.patience)
                and self.state.bad_validations >= self.cfg.train.patience
            )
        return agree(self.dist, self.device, stop)[0]

    def _checkpoint(self, metrics: dict[str, float], rng: Any) -> dict[str, Any]:
        return training_checkpoint(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            metrics=metrics,
            rng=rng,
            cfg=self.cfg,
            tokenizer=self.tokenizer,
            train_state={**dataclasses.asdict(self.state), "seconds": self.minutes() * 60},
        )

    def save(self, metrics: dict[str, float], *, best: bool = False, rng: Any = None) -> None:
        """last.pt, step_N.pt and best.pt (when improved); `metrics` are this step's validation, or
        none. Every rank calls it unless `rng` (all ranks' RNG states) is given; rank 0 writes."""
        rng = gathered_rng(self.dist) if rng is None else rng
        if self.dist.main:
            save_rotating(
                self.run_dir,
                self._checkpoint(metrics, rng),
                best=best,
                keep_last=self.cfg.train.keep_last,
            )


# --------------------------------------------------------------------------- validation


def validate(
    model: Transformer,
    data: TrainingData,
    refs: list[str] | None,
    tokenizer: Tokenizer,
    cfg: Config,
    precision: str,
    device: torch.device,
) -> dict[str, float]:
    """Validation loss and perplexity, and BLEU against `refs` when given; empty without a valid
    split. The model is left in training mode."""
    if data.valid is None:
        return {}
    loss = validation_loss(model, data, cfg.train.max_tokens, precision, device)
    metrics = {"loss": loss, "ppl": math.exp(min(loss, 50.0))}
    if refs is not None:
        hyps = validation_hypotheses(
            model, data.valid, cfg.decode, cfg.train.valid_beam, precision, device
        )
        metrics["bleu"] = score(
            tokenizer.decode_tgt(hyps), refs, names=("bleu",), lang=cfg.data.tgt_lang
        )["bleu"]
    model.train()
    return metrics


@torch.no_grad()
def validation_loss(
    model: Transformer, data: TrainingData, max_tokens: int, precision: str, device: torch.device
) -> float:
    """Label-smoothing-free cross-entropy per target token over the usable validation pairs."""
    model.eval()
    valid, idx = data.valid, data.valid_idx
    total, tokens = torch.zeros((), device=device), 0
    for b in make_batches(
        valid.src_lens[idx], valid.tgt_lens[idx], max_tokens, seed=0, epoch=0, shuffle=False
    ):
        batch = collate(valid, idx[b]).to(device)
        with autocast(precision, device):
            logits = model(batch.src, batch.tgt_in)
        total += label_smoothed_loss(logits, batch.tgt_out, 0.0)
        tokens += batch.n_tgt_tokens
    return total.item() / max(tokens, 1)


def validation_hypotheses(
    model: Transformer,
    valid: TokenizedCorpus,
    decode: DecodeConfig,
    beam: int,
    precision: str,
    device: torch.device,
) -> list[list[int]]:
    """Output ids for every validation source, decoded from the cached token ids in the run's
    precision."""
    model, _ = inference_model(model, precision, device)
    hyps = translate_ids(model, [valid.src(i) for i in range(len(valid))], decode, beam=beam)
    return [nbest[0].tokens for nbest in hyps]


def average_and_validate(
    run_dir: Path,
    n: int,
    model: Transformer,
    validate: Callable[[], dict[str, float]],
    best_score: float,
) -> None:
    """Average the newest n step checkpoints into averaged.pt; it becomes best.pt if it validates
    better."""
    ckpt_dir, paths = run_dir / "checkpoints", step_checkpoints(run_dir)[-n:]
    if len(paths) < 2:
        log.warning(
            "train.average_last=%d: only %d step checkpoint(s) to average; skipped", n, len(paths)
        )
        return
    averaged = average_checkpoints(paths)
    model.load_state_dict(averaged["model"])
    averaged["metrics"] = metrics = validate()
    save_checkpoint(ckpt_dir / "averaged.pt", averaged)
    current = validation_score(metrics)
    better = current is not None and current > best_score
    if better:
        copy_checkpoint(ckpt_dir / "averaged.pt", ckpt_dir / "best.pt")  # serialised once
    log.info(
        "averaged %d checkpoints (steps %s): valid %s%s",
        len(paths),
        ", ".join(str(step_of(p)) for p in paths),
        " ".join(f"{k} {v:.2f}" for k, v in metrics.items()),
        " (best: now best.pt)" if better else "",
    )


class _NullWriter:
    """Stands in for the SummaryWriter on ranks other than 0."""

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM: the step finished and last.pt was written; the CLI exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class TrainingDiverged(UserError):
    """The loss became NaN or infinite; the last checkpoint written before it is kept."""

    @classmethod
    def at(cls, loss: float, first: int, step: int, last: Path) -> "TrainingDiverged":
        kept = (
            f"the last good checkpoint is {last}"
            if last.exists()
            else "no checkpoint was written yet"
        )
        return cls(
            f"the training loss became {loss} between steps {first} and {step}; stopped, {kept} "
            "(lower train.lr_factor, raise train.warmup or set train.clip_norm)"
        )


def train(cfg: Config, resume: str | Path | bool | None = None) -> dict[str, Any]:
    """Train a model as the config says; the run directory is cfg.output_dir. Under torchrun the
    process group is left on the way out, also on errors and interruptions."""
    clean = False
    try:
        summary = Trainer(cfg, resume).train()
        clean = True
        return summary
    finally:
        leave_distributed(clean)

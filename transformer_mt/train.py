"""The training loop and its state: updates, limits (`Stop`), validation and checkpoints.

The loop's whole state is one `TrainState` saved in every checkpoint, and the batch order is a
pure function of (seed, epoch) (data.EpochBatches): resuming mid-epoch, or sharding batches across
data-parallel ranks, is a matter of skipping or striding through that list. Setting a run up is
prepare.py's, Adam and the schedule optim.py's, the checkpoint format checkpoint.py's, validation
evaluate.py's (through inference.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from .checkpoint import (
    average_last,
    load_training_checkpoint,
    restore_training,
    save_checkpoint,
    save_rotating,
    start_from,
    training_checkpoint,
    validation_score,
)
from .config import Config, TrainConfig
from .data import Batch, EpochBatches, read_split, word_dropout
from .distributed import agree, agree_min, gathered_rng, global_sum, leave_distributed, restore_rng
from .errors import TrainingDiverged, TrainingInterrupted
from .evaluate import validation_metrics
from .model import label_smoothed_loss, symmetric_kl
from .optim import build_optimizer, cooldown_by_steps, plan_cooldown, plan_warmup, warmup_by_steps
from .prepare import (
    NullWriter,
    attention_chooser,
    build_model,
    chunked_loss,
    describe_run,
    init_runtime,
    open_event_log,
    prepare_run,
    progress_bar,
    set_up_precision,
    training_forward,
    training_loss,
)
from .runtime import (
    Meter,
    StopSignals,
    attention_kernel,
    autocast,
    compute_dtype,
    matmul_gflops,
)

log = logging.getLogger("transformer_mt")


class Stop(enum.Enum):
    """Why a run stops, in order of precedence (where several fire at one step, the first is the
    summary's `stopped`); each value is the text that logs and the summary give (`text`)."""

    MAX_STEPS = "train.max_steps={max_steps} reached"
    COOLDOWN_DONE = "the cooldown's last update (train.cooldown={cooldown:g}) done"
    MAX_EPOCHS = "train.max_epochs={max_epochs} reached"
    MAX_MINUTES = "train.max_minutes={max_minutes:g} reached"
    PATIENCE = "no better validation score in train.patience={patience} validations"

    def text(self, tc: TrainConfig) -> str:
        return self.value.format(**dataclasses.asdict(tc))


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
    attention: str = ""  # the attention kernel it trains with (train.attention auto's choice)
    # precision auto's start-up timings, ms a step in each precision timed (none: not measured)
    precision_probe_ms: dict[str, float] = field(default_factory=dict)
    # the lr decays (train.cooldown_shape) from update cooldown_start to ~0 at cooldown_end
    cooldown_start: int = 0
    cooldown_end: int = 0  # (both 0: no cooldown); see optim.cooldown_by_steps, _plan_cooldown
    warmup: int = 0  # the warm-up's updates once planned (0: optim.warmup_by_steps until then)
    # under train.bidirectional_share, the last epoch trained both ways once the share is reached
    # (0: not yet)
    bidirectional_until: int = 0

    def summary(self, stopped: str, minutes: float, run_dir: Path, rank: int) -> dict[str, Any]:
        """What `train` returns: how far the run got, why it stopped, its best validation."""
        return {
            "steps": self.step,
            "epochs": self.epoch,
            "minutes": round(minutes, 2),
            "best_score": self.best_score,
            "best_step": self.best_step,
            "target_tokens": self.target_tokens,
            "stopped": stopped,
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


def limits_reached(
    tc: TrainConfig, state: TrainState, *, epochs_done: bool = False, out_of_time: bool = False
) -> list[Stop]:
    """The limits that end the run at the state's step, in Stop's order of precedence."""
    fired = {
        Stop.MAX_STEPS: state.step >= tc.max_steps,
        Stop.COOLDOWN_DONE: state.step >= state.cooldown_end > 0,
        Stop.MAX_EPOCHS: epochs_done,
        Stop.MAX_MINUTES: out_of_time,
    }
    return [stop for stop, hit in fired.items() if hit]


def stopped_already(tc: TrainConfig, state: TrainState, batches: EpochBatches) -> Stop | None:
    """Why a resumed run has nothing left to train (None if it has): a limit it had reached when it
    was saved. A run saved after its last epoch's last batch still counts that epoch (the stream
    moves on only when asked)."""
    last_done = (
        state.epoch == tc.max_epochs
        and state.batch_in_epoch >= len(batches.epoch(state.epoch)) // batches.world
    )
    fired = limits_reached(
        tc,
        state,
        epochs_done=state.epoch > tc.max_epochs or last_done,
        out_of_time=bool(tc.max_minutes) and state.seconds >= 60 * tc.max_minutes,
    )
    return fired[0] if fired else None


class Trainer:
    """Builds data, tokenizer, model and optimizer from a Config and runs the loop: a new run, a
    resumed one (`resume`), or a new one from another run's weights (`init_from`: fine-tuning)."""

    def __init__(self, cfg: Config, resume: str | Path | bool | None = None, init_from: Any = None):
        self.started = time.perf_counter()
        self.cfg, self.run_dir, tc = cfg, Path(cfg.output_dir), cfg.train
        resume_from, parent = start_from(self.run_dir, resume, init_from, cfg)
        self.dist, self.device = init_runtime(tc)
        resumed = resume_from and load_training_checkpoint(resume_from, map_location=self.device)
        self.parent = resumed.get("parent") if resumed else parent and parent.record()
        self.tokenizer, self.data = prepare_run(cfg, self.run_dir, self.dist, parent)
        self.batches = EpochBatches(self.data, tc, self.dist.rank, self.dist.world)
        bleu = self.data.valid is not None and tc.valid_bleu and self.dist.main  # rank 0 validates
        self.valid_refs = read_split(cfg.data, "valid")[1] if bleu else None  # raw text, for BLEU
        self.model = build_model(cfg, self.tokenizer, parent).to(self.device)
        kernel_for = attention_chooser(self.model, tc, self.device, resumed)
        probe_ms: dict[str, float] = {}  # precision auto's timings, when it measures here
        self.precision = set_up_precision(
            self.model, tc, self.dist, self.device, resumed, kernel_for, probe_ms
        )
        self.attention = kernel_for(self.precision)
        self.forward = training_forward(self.model, tc, self.dist, self.device)
        self.chunked_loss = chunked_loss(tc, self.device)
        # a resumed run's state replaces this one (_restore), its own probe timings with it
        self.state = TrainState(precision_probe_ms=probe_ms)
        self.writer = NullWriter()  # the event log opens in _start
        self.optimizer, self.scheduler = build_optimizer(
            self.model,
            tc,
            self.device,
            lambda: (self.state.cooldown_start, self.state.cooldown_end),
            lambda: self.state.warmup or warmup_by_steps(tc),
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        # told (step, planned last step) after every update: an ensemble's member reports to its
        # parent (members.py)
        self.on_update: Callable[[int, int], None] | None = None
        self.signal_grace = 0.0  # seconds in which a repeated signal is the same request
        if resumed is not None:
            self._restore(resume_from, resumed)
        if self.state.bidirectional_until:  # a resumed run whose share was reached
            self.batches.bidirectional_until = self.state.bidirectional_until

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
        restore_rng(self.dist, ckpt["rng"])

    def train(self) -> dict[str, Any]:
        """Run until max_steps, max_epochs, the time budget or early stopping, and return a summary;
        a resumed run that had stopped there trains and writes nothing. DDP ranks agree at log and
        validation steps only."""
        done = stopped_already(self.cfg.train, self.state, self.batches)
        if done is not None:
            stopped = done.text(self.cfg.train)
            log.info(
                "nothing to train: %s when the resumed checkpoint was written; its checkpoints "
                "are left as they are",
                stopped,
            )
            return self.state.summary(stopped, self.minutes(), self.run_dir, self.dist.rank)
        try:
            return self._train()
        finally:
            self.writer.close()  # flushed and closed on every way out: NaN, signals, errors

    def _train(self) -> dict[str, Any]:
        """The loop: update, check the limits, report, validate and save, until a limit fires."""
        tc = self.cfg.train
        bar, peak = self._start()
        batches = self.batches.stream(self.state)
        meter = Meter(self.device, self.state.step + 1, peak)
        since = self.state.step, self.minutes()  # this process's step rate, for the plans
        validated_at, fired = -1, []
        self.model.train()
        with StopSignals(self.signal_grace) as signals:
            while not fired:
                pairs = list(itertools.islice(batches, tc.accumulate))
                if not pairs:
                    fired = [Stop.MAX_EPOCHS]
                    break
                self._step(pairs, meter, bar)
                fired, interrupted = self._check_limits(bar, signals, since)
                self._report(meter, bar, last=bool(fired) or interrupted)
                if interrupted and not fired:
                    self._stop_interrupted(bar, signals.caught)
                if self._validate_or_save(bar, fired):
                    validated_at = self.state.step
        if validated_at != self.state.step:
            self.validate_and_save(bar)  # keep the final weights too
        bar.close()
        return self._finish(fired)

    def _step(self, pairs: list[tuple[Batch, int]], meter: Meter, bar: tqdm) -> None:
        """One update over the accumulated (batch, all ranks' target tokens) pairs, counted."""
        micro, tokens = [b for b, _ in pairs], sum(n for _, n in pairs)
        flops = sum(self.model.train_flops(b.src, b.tgt_out) for b in micro)  # on the host: no sync
        meter.add(self.train_step(micro, tokens), tokens, flops)
        self.state.step += 1
        self.state.target_tokens += tokens
        bar.update(1)
        if self.on_update is not None:
            self.on_update(self.state.step, bar.total or 0)

    def _check_limits(
        self, bar: tqdm, signals: StopSignals, since: tuple[int, float]
    ) -> tuple[list[Stop], bool]:
        """The limits this step reached, and whether a signal asks to stop. Ranks agree on the clock
        and on signals at log and validation steps (a host sync); there, a time budget that will end
        the run before max_steps starts the cooldown over its last part, and after a minute of
        training plans the warm-up (train.warmup_share) from the updates the budget holds, then
        plans it again every log_every updates until it ends: a minute's rate on a shared machine
        can be half the hour's. There, too, bidirectional training ends once its share of the
        budget is spent."""
        tc, step, warmup = self.cfg.train, self.state.step, self.state.warmup
        now, budget = self.minutes(), tc.max_minutes or math.inf
        cooling_due = step < self.state.cooldown_start and now >= (1 - tc.cooldown) * budget
        one_way_due = bool(tc.bidirectional_share) and not self.state.bidirectional_until
        if one_way_due:  # a share of the time budget, or of max_steps without one
            spent = now / tc.max_minutes if tc.max_minutes else step / tc.max_steps
            one_way_due = spent >= tc.bidirectional_share
        warmup_due = (
            bool(tc.warmup_share and tc.max_minutes)
            and now - since[1] >= 1.0
            and (not warmup or step < warmup and step % tc.log_every == 0)
        )
        due = self.dist.world == 1 or step % tc.log_every == 0 or step % tc.valid_every == 0
        out_of_time, interrupted, cool, warm, one_way = (
            agree(
                self.dist,
                self.device,
                now >= budget,
                signals.caught is not None,
                cooling_due,
                warmup_due,
                one_way_due,
            )
            if due
            else (False,) * 5
        )
        rate = (step - since[0]) / max(now - since[1], 1e-9)
        fewest = lambda n: agree_min(self.dist, self.device, n)  # noqa: E731
        if warm:  # the lr of the update after this one was set before the plan; the next is not
            self.state.warmup = plan_warmup(tc, step, now, rate, fewest, first=not warmup)
        if cool:  # the time budget ends the run before max_steps: cool down over its last part
            plan = plan_cooldown(tc, step, now, rate, fewest)
            self.state.cooldown_start, self.state.cooldown_end = plan
            bar.total = self.state.cooldown_end
        if one_way:
            self._end_bidirectional(now)
        return limits_reached(tc, self.state, out_of_time=out_of_time), interrupted

    def _end_bidirectional(self, minutes: float) -> None:
        """train.bidirectional_share is spent: the epoch under way is the last trained both ways
        (the batches of an epoch are fixed when it starts, so a resume streams the same ones)."""
        self.state.bidirectional_until = self.batches.bidirectional_until = self.state.epoch
        if self.dist.main:
            log.info(
                "bidirectional training ends with epoch %d (update %d, %.1f min: "
                "train.bidirectional_share=%g spent); later epochs train one way",
                self.state.epoch,
                self.state.step,
                minutes,
                self.cfg.train.bidirectional_share,
            )

    def _validate_or_save(self, bar: tqdm, fired: list[Stop]) -> bool:
        """At validation steps and the last, validate and save, adding Stop.PATIENCE to `fired` when
        early stopping says so; between them, save every train.save_every steps. True if it
        validated."""
        step, tc = self.state.step, self.cfg.train
        if step % tc.valid_every == 0 or fired:
            if self.validate_and_save(bar):
                fired.append(Stop.PATIENCE)
            return True
        if tc.save_every and step % tc.save_every == 0:
            # not validated: it carries no metrics, so `average --best` does not rank it
            self.save({})
        return False

    def _start(self) -> tuple[tqdm, float]:
        """Open the event log (rank 0), say what is trained; the progress bar and the matmul
        GFLOP/s."""
        tc, main, self.state.precision = self.cfg.train, self.dist.main, self.precision
        self.state.attention = self.attention
        if not self.state.cooldown_end:  # by steps; the time budget may move it earlier
            self.state.cooldown_start, self.state.cooldown_end = cooldown_by_steps(tc)
        if not (self.state.warmup or tc.warmup_share and tc.max_minutes):
            self.state.warmup = warmup_by_steps(tc)  # else planned after the first minute
        self.writer = open_event_log(self.run_dir, self.dist)
        if main:
            n = len(self.batches.epoch(1))
            describe_run(tc, self.dist, self.device, self.precision, self.model, self.data, n)
        m = self.cfg.model
        bar = progress_bar(self.state.cooldown_end or tc.max_steps, self.state.step, main)
        return bar, matmul_gflops(
            self.device, compute_dtype(self.precision), 4096, m.d_model, m.d_ff
        )

    def _report(self, meter: Meter, bar: tqdm, last: bool) -> None:
        """At log and validation steps and the last: stop on a non-finite loss; on log steps, show
        and record loss, lr, tokens/s and MFU."""
        step, tc = self.state.step, self.cfg.train
        logged = step % tc.log_every == 0
        if not (logged or step % tc.valid_every == 0 or last):
            return
        loss = global_sum(self.dist, meter.loss) / max(meter.tokens, 1)  # the window's host sync
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

    def _finish(self, fired: list[Stop]) -> dict[str, Any]:
        """Say why the run stopped (the first limit that fired, then any others), average the last
        checkpoints, and return the summary."""
        tc = self.cfg.train
        stopped = fired[0].text(tc)
        if self.dist.main:
            log.info("stopped: %s", stopped)
            if len(fired) > 1:
                log.info("(also: %s)", "; ".join(stop.text(tc) for stop in fired[1:]))
        averaged = None
        if self.dist.main and tc.average_last > 1:
            averaged = average_last(
                self.run_dir, tc.average_last, self._validate_weights, self.state.best_score
            )
        self.writer.close()
        summary = self.state.summary(stopped, self.minutes(), self.run_dir, self.dist.rank)
        if averaged is not None:  # best.pt is now the average: the summary says what it scored
            summary.update(best_score=averaged, best_step=self.state.step, best_averaged=True)
        return summary

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
            ddp = getattr(self.forward, "_orig_mod", self.forward)  # DDP, even when compiled
            last = i == len(micro) - 1
            # micro-steps skip all-reduce
            with contextlib.nullcontext() if last or world == 1 else ddp.no_sync():
                loss, objective = self._loss(batch)
                self.scaler.scale(objective * (world / n_tokens)).backward()
            total += loss.detach()
        if tc.clip_norm > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.clip_norm)
        self.scaler.step(self.optimizer)  # skipped when a scaled gradient is inf or NaN (fp16)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total

    def _loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch's summed label-smoothed loss (what the log shows) and the objective to
        minimise: the same, or with R-Drop the two passes' mean loss plus their consistency term."""
        tc, passes = self.cfg.train, self.cfg.train.passes
        tgt_rate = tc.word_dropout if tc.target_word_dropout is None else tc.target_word_dropout
        # With R-Drop both passes go in one forward over the batch stacked on itself: each row gets
        # its own dropout and word-dropout masks.
        src = word_dropout(batch.src.repeat(passes, 1), tc.word_dropout)  # (passes·B, S)
        tgt_in = word_dropout(batch.tgt_in.repeat(passes, 1), tgt_rate)  # (passes·B, T)
        tgt_out = batch.tgt_out.repeat(passes, 1)  # (passes·B, T)
        with autocast(self.precision, self.device), attention_kernel(self.attention):
            if passes == 1:  # in chunks where prepare.chunked_loss says so, as the probe timed it
                loss = training_loss(
                    self.forward, src, tgt_in, tgt_out, tc.label_smoothing, self.chunked_loss
                )
                return loss, loss
            logits = self.forward(src, tgt_in)  # (passes·B, T, V)
        loss = label_smoothed_loss(logits, tgt_out, tc.label_smoothing) / passes
        first, second = logits.chunk(2)  # (B, T, V) each
        # Liang et al.'s NLL1 + NLL2 + α/2·(KL(1‖2) + KL(2‖1)), halved: per pass, as without it
        return loss, loss + tc.r_drop * symmetric_kl(first, second, batch.tgt_out) / 4

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
            patience = self.cfg.train.patience
            stop = bool(patience) and self.state.bad_validations >= patience
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
            parent=self.parent,
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

    def validation_metrics(self) -> dict[str, float]:
        return validation_metrics(
            self.model,
            self.data,
            self.valid_refs,
            self.tokenizer,
            self.cfg,
            self.precision,
            self.device,
        )

    def _validate_weights(self, weights: dict[str, Any]) -> dict[str, float]:
        """The validation metrics of other weights (an average): loaded into the model."""
        self.model.load_state_dict(weights["model"])
        return self.validation_metrics()


def train(cfg: Config, resume: Any = None, init_from: Any = None) -> dict[str, Any]:
    """Train a model as the config says (resumed, or fine-tuned from `init_from`: see Trainer).
    Under torchrun the process group is left on the way out, also on errors and interruptions."""
    clean = False
    try:
        summary = Trainer(cfg, resume, init_from).train()
        clean = True
        return summary
    finally:
        leave_distributed(clean)

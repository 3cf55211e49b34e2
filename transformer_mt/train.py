"""The training loop: Adam + Noam schedule, label-smoothed cross-entropy, validation, checkpoints.

The loop's whole state is one `TrainState` saved in every checkpoint, and the batch order is a
pure function of (seed, epoch): resuming mid-epoch, or sharding batches across data-parallel
ranks, is a matter of skipping or striding through that list.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from .checkpoint import CheckpointError, average_checkpoints, load_checkpoint, save_checkpoint, step_checkpoints
from .config import Config, save_config
from .data import (Batch, DataError, TokenizedCorpus, cache_dir, collate, iter_split, load_tokenized,
                   make_batches, read_split, usable_indices)
from .errors import UserError
from .evaluate import score
from .model import Transformer, build_model
from .tokenizer import PAD, Tokenizer, train_tokenizer
from .translate import Translator, pick_device, resolve_precision

log = logging.getLogger("transformer_mt")


def noam(step: int, d_model: int, warmup: int, factor: float) -> float:
    """lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (Sec. 5.3, Eq. 3)."""
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Summed label-smoothed cross-entropy over non-padding targets (Sec. 5.4). logits (..., V)."""
    V = logits.size(-1)
    return F.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1), ignore_index=PAD,
                           label_smoothing=smoothing, reduction="sum")


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


class Trainer:
    """Builds data, tokenizer, model and optimizer from a Config and runs the loop."""

    def __init__(self, cfg: Config, resume: Optional[str | Path | bool] = None):
        self.started = time.perf_counter()
        self.cfg = cfg
        self.metrics: dict[str, float] = {}
        self.stop_signal: Optional[str] = None
        self.run_dir = Path(cfg.output_dir)
        tc = cfg.train
        resume_from = self._resume_path(resume)
        if tc.threads:
            torch.set_num_threads(tc.threads)
        _seed_everything(tc.seed)
        self.rank, self.world, local_rank = init_distributed(tc.device)
        self.device = pick_device(tc.device)
        if self.device.type == "cuda" and self.world > 1:
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        self.precision = resolve_precision(tc.precision, self.device)

        with self.rank_zero_first():  # rank 0 trains the tokenizer and fills the cache; the others read them
            if self.rank == 0:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                save_config(cfg, self.run_dir / "config.yaml")
            self.tokenizer = self._tokenizer()
            cache = cache_dir(cfg.data)
            self.train_data = load_tokenized(cfg.data, "train", self.tokenizer, cache)
            self.valid_data: Optional[TokenizedCorpus] = None
            if cfg.data.valid is not None:
                self.valid_data = load_tokenized(cfg.data, "valid", self.tokenizer, cache)
        self.train_idx = usable_indices(self.train_data, cfg.data.max_len, "train")
        self.valid_text: Optional[tuple[list[str], list[str]]] = None
        if self.valid_data is not None:
            self.valid_idx = usable_indices(self.valid_data, cfg.model.max_positions - 1, "valid")
            if tc.valid_bleu and self.rank == 0:
                self.valid_text = read_split(cfg.data, "valid")

        self.model: Transformer = build_model(cfg.model, self.tokenizer.src_vocab_size,
                                              self.tokenizer.tgt_vocab_size, self.tokenizer.joint).to(self.device)
        # The training forward may be wrapped (DDP, torch.compile); checkpoints take the state dict of the
        # plain module, so they load without either.
        self.forward = self.model
        if self.world > 1:
            self.forward = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if tc.compile:
            self.forward = torch.compile(self.forward, dynamic=True)
        fused = {"fused": True} if self.device.type == "cuda" else {"foreach": True}
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1.0, betas=tc.adam_betas, eps=tc.adam_eps,
                                          weight_decay=tc.weight_decay, **fused)
        # LambdaLR counts from 0 before the first update; update number s uses noam(s).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda i: noam(i + 1, cfg.model.d_model, tc.warmup, tc.lr_factor))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.state = TrainState()
        self.writer = None
        if resume_from is not None:
            self._restore(resume_from)

    # ------------------------------------------------------------------ resuming

    def _resume_path(self, resume: Optional[str | Path | bool]) -> Optional[Path]:
        """The checkpoint to resume from; refuses to start over a run that has checkpoints."""
        last = self.run_dir / "checkpoints" / "last.pt"
        if resume is None or resume is False:
            if last.exists():
                raise UserError(f"{self.run_dir} already holds a run (checkpoints/last.pt): add --resume to "
                                "continue it, or set another output_dir (or delete the folder) to start over")
            return None
        path = last if resume is True else Path(resume)
        if not path.is_file():
            raise CheckpointError(f"cannot resume: checkpoint not found: {path}")
        return path

    def _restore(self, path: Path) -> None:
        """Model, optimizer, schedule, scaler, loop position and every RNG, as they were when saved."""
        ckpt = load_checkpoint(path, map_location=self.device)
        if ckpt.get("tokenizer") != self.tokenizer.digest:
            raise CheckpointError(f"cannot resume from {path}: it was trained with tokenizer {ckpt.get('tokenizer')}, "
                                  f"but {self.run_dir} has SentencePiece model {self.tokenizer.digest}")
        saved = ckpt["config"].get("model", {})
        diff = [f"model.{k}: checkpoint {saved.get(k)!r}, config {v!r}"
                for k, v in dataclasses.asdict(self.cfg.model).items() if saved.get(k) != v]
        if diff:
            raise CheckpointError(f"cannot resume from {path}: the model config differs: " + "; ".join(diff))
        if "optimizer" not in ckpt or "train_state" not in ckpt:
            raise CheckpointError(f"cannot resume from {path}: it holds weights only (an averaged checkpoint?)")
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt.get("scaler", {}))
        self.state = TrainState(**ckpt["train_state"])
        self.metrics = ckpt.get("metrics") or {}
        rng = ckpt["rng"]
        if isinstance(rng, list):  # saved under DDP: one state per rank
            if len(rng) != self.world:
                log.warning("resuming %d-process RNG states with %d processes: random streams will differ",
                            len(rng), self.world)
            rng = rng[self.rank % len(rng)]
        set_rng_state(rng)
        log.info("resumed from %s: step %d, epoch %d, batch %d of the epoch", path, self.state.step,
                 self.state.epoch, self.state.batch_in_epoch)

    # ------------------------------------------------------------------ set-up helpers

    def _tokenizer(self) -> Tokenizer:
        """Reuse the run's SentencePiece model if there is one; otherwise train it on the train split."""
        if Tokenizer.exists(self.run_dir):
            return Tokenizer.load(self.run_dir)
        log.info("training SentencePiece (%s, %d pieces, %s) on the training split", self.cfg.tokenizer.type,
                 self.cfg.tokenizer.vocab_size, "joint" if self.cfg.tokenizer.joint else "separate")
        pairs = lambda: iter_split(self.cfg.data, "train")  # noqa: E731  streamed, twice
        if next(pairs(), None) is None:
            raise DataError("data.train: the corpus is empty")
        tok = train_tokenizer(self.cfg.tokenizer, (s for s, _ in pairs()), (t for _, t in pairs()),
                              seed=self.cfg.train.seed)
        tok.save(self.run_dir)
        return tok

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed-precision autocast for the run's precision (fp32: none)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16)

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """All ranks' batches of one epoch (indices into the training corpus), cut to a multiple of the
        world size; rank r takes batches r, r + world, r + 2*world, ..."""
        idx = self.train_idx
        batches = make_batches(self.train_data.src_lens[idx], self.train_data.tgt_lens[idx],
                               self.cfg.train.max_tokens, seed=self.cfg.train.seed, epoch=epoch)
        return [idx[b] for b in batches[:len(batches) // self.world * self.world]]

    def _batches(self) -> Iterator[tuple[Batch, int]]:
        """Endless stream of (this rank's batch, target tokens of that batch summed over all ranks)
        from the current position (epoch, batch_in_epoch counts this rank's batches)."""
        tgt_lens = self.train_data.tgt_lens
        while self.state.epoch <= self.cfg.train.max_epochs:
            batches = self.epoch_batches(self.state.epoch)
            while self.state.batch_in_epoch < len(batches) // self.world:
                j = self.state.batch_in_epoch * self.world
                group = batches[j:j + self.world]  # this step's batches of every rank
                self.state.batch_in_epoch += 1
                yield collate(self.train_data, group[self.rank]), sum(int(tgt_lens[b].sum()) + len(b) for b in group)
            self.state.epoch += 1
            self.state.batch_in_epoch = 0

    @contextlib.contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. writes a cache); the other ranks run it after (and read it)."""
        if self.world > 1 and self.rank != 0:
            dist.barrier()
        yield
        if self.world > 1 and self.rank == 0:
            dist.barrier()

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict[str, Any]:
        """Run until max_steps, max_epochs, the time budget or early stopping; return a summary."""
        tc = self.cfg.train
        from torch.utils.tensorboard import SummaryWriter  # imported late: slow, and only the loop needs it

        main = self.rank == 0  # only rank 0 logs, writes TensorBoard events and checkpoints
        self.writer = SummaryWriter(str(self.run_dir / "tb")) if main else _NullWriter()
        if main:
            log.info("device %s, precision %s, %.2fM parameters, %d training pairs, %d batches/epoch of <= %d "
                     "tokens; effective batch <= %d tokens (max_tokens %d x accumulate %d x %d process%s)",
                     self.device, self.precision, self.model.num_parameters() / 1e6, len(self.train_idx),
                     len(self.epoch_batches(1)), tc.max_tokens, tc.max_tokens * tc.accumulate * self.world,
                     tc.max_tokens, tc.accumulate, self.world, "es" if self.world > 1 else "")
        bar = tqdm(total=tc.max_steps, initial=self.state.step, desc="train", unit="step", dynamic_ncols=True,
                   mininterval=1.0, disable=not main)
        batches = self._batches()
        peak = matmul_gflops(self.device, self.precision, self.cfg.model.d_model, self.cfg.model.d_ff)
        window_loss = torch.zeros((), device=self.device)
        window_tokens, window_flops = 0, 0.0
        window_start, window_first = time.perf_counter(), self.state.step + 1
        validated_at, reason = -1, ""
        self.model.train()
        with self._stop_on_signals():
            while not reason:
                pairs = [p for _, p in zip(range(tc.accumulate), batches)]
                if not pairs:
                    reason = f"train.max_epochs={tc.max_epochs} reached"
                    break
                micro, global_tokens = [b for b, _ in pairs], sum(n for _, n in pairs)
                window_loss += self.train_step(micro, global_tokens)
                window_tokens += global_tokens
                window_flops += sum(self.model.train_flops(b.src, b.tgt_out) for b in micro)  # host tensors
                self.state.step += 1
                self.state.target_tokens += global_tokens
                bar.update(1)
                step = self.state.step
                out_of_time, interrupted = self._agree(bool(tc.max_minutes and self.minutes() >= tc.max_minutes),
                                                       self.stop_signal is not None)
                if step >= tc.max_steps:
                    reason = f"train.max_steps={tc.max_steps} reached"
                elif out_of_time:
                    reason = f"train.max_minutes={tc.max_minutes:g} reached"
                if step % tc.log_every == 0 or step % tc.valid_every == 0 or reason or interrupted:
                    loss = self._sum(window_loss) / max(window_tokens, 1)  # the one host sync per window
                    if not math.isfinite(loss):
                        bar.close()
                        last = self.run_dir / "checkpoints" / "last.pt"
                        kept = (f"the last good checkpoint is {last}" if last.exists()
                                else "no checkpoint was written yet")
                        raise TrainingDiverged(
                            f"the training loss became {loss} between steps {window_first} and {step}; stopped, "
                            f"{kept} (lower train.lr_factor, raise train.warmup or set train.clip_norm)")
                if step % tc.log_every == 0:
                    now = time.perf_counter()
                    lr = self.scheduler.get_last_lr()[0]
                    tok_s = window_tokens / max(now - window_start, 1e-9)
                    mfu = window_flops / max(now - window_start, 1e-9) / 1e9 / peak  # per device
                    budget = {"min": f"{self.minutes():.1f}/{tc.max_minutes:g}"} if tc.max_minutes else {}
                    bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", mfu=f"{mfu:.0%}",
                                    **budget)
                    self.writer.add_scalar("train/loss", loss, step)
                    self.writer.add_scalar("train/lr", lr, step)
                    self.writer.add_scalar("train/tokens_per_sec", tok_s, step)
                    self.writer.add_scalar("train/mfu", mfu, step)
                    window_loss.zero_()
                    window_tokens, window_flops, window_start, window_first = 0, 0.0, now, step + 1
                if interrupted and not reason:
                    bar.close()
                    state = self.checkpoint_state()
                    if main:
                        save_checkpoint(self.run_dir / "checkpoints" / "last.pt", state)
                    self.writer.close()
                    raise TrainingInterrupted(
                        f"{self.stop_signal or 'signal'}: stopped after step {step}, saved "
                        f"{self.run_dir / 'checkpoints' / 'last.pt'}; continue with the same command plus --resume",
                        143 if self.stop_signal == "SIGTERM" else 130)
                if step % tc.valid_every == 0 or reason:
                    validated_at = step
                    if self.validate_and_save(bar) and not reason:
                        reason = f"no better validation score in train.patience={tc.patience} validations"
                elif tc.save_every and step % tc.save_every == 0:
                    rng = self._gathered_rng()  # every rank takes part; rank 0 writes
                    if main:
                        self.save(rng=rng)
        if validated_at != self.state.step:
            self.validate_and_save(bar)  # keep the final weights too
        bar.close()
        if main:
            log.info("stopped: %s", reason)
        if tc.average_last > 1 and main:
            self.average_and_validate(tc.average_last)
        self.writer.close()
        return {"steps": self.state.step, "epochs": self.state.epoch, "minutes": round(self.minutes(), 2),
                "best_score": self.state.best_score, "best_step": self.state.best_step,
                "target_tokens": self.state.target_tokens, "stopped": reason, "run_dir": str(self.run_dir)}

    def _agree(self, *flags: bool) -> tuple[bool, ...]:
        """Flags that any rank raised, seen by every rank (one tiny all-reduce per step under DDP)."""
        if self.world == 1:
            return flags
        t = torch.tensor([float(f) for f in flags], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(bool(x) for x in t.tolist())

    def _sum(self, t: torch.Tensor) -> float:
        """A device scalar summed over ranks, as a Python float (a host sync)."""
        if self.world > 1:
            t = t.clone()
            dist.all_reduce(t)
        return t.item()

    @contextlib.contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM ask the loop to finish its step and write last.pt; a second one stops at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self.stop_signal is not None:
                raise KeyboardInterrupt
            self.stop_signal = signal.Signals(signum).name
            tqdm.write(f"tmt: {self.stop_signal}: finishing this step and writing last.pt "
                       "(press Ctrl-C again to stop at once)")

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, h in previous.items():
                signal.signal(sig, h)

    def minutes(self) -> float:
        """Training wall-clock so far (set-up included), summed over resumed runs."""
        return (self.state.seconds + time.perf_counter() - self.started) / 60

    def average_and_validate(self, n: int) -> None:
        """Average the newest n step checkpoints into averaged.pt; it becomes best.pt if it validates better."""
        ckpt_dir = self.run_dir / "checkpoints"
        paths = step_checkpoints(self.run_dir)[-n:]
        if len(paths) < 2:
            log.warning("train.average_last=%d: only %d step checkpoint(s) to average; skipped", n, len(paths))
            return
        averaged = average_checkpoints(paths)
        self.model.load_state_dict(averaged["model"])
        metrics = self.validation_metrics()
        averaged["metrics"] = metrics
        save_checkpoint(ckpt_dir / "averaged.pt", averaged)
        score_ = metrics.get("bleu", -metrics.get("loss", 0.0))
        better = score_ > self.state.best_score
        if better:
            save_checkpoint(ckpt_dir / "best.pt", averaged)
        log.info("averaged %d checkpoints (steps %s): valid %s%s", len(paths),
                 ", ".join(p.stem.split("_")[1] for p in paths),
                 " ".join(f"{k} {v:.2f}" for k, v in metrics.items()), " (best: now best.pt)" if better else "")

    def train_step(self, micro: list[Batch], global_tokens: Optional[int] = None) -> torch.Tensor:
        """One optimizer update over `micro` batches; returns the summed loss (a device tensor).

        The loss is normalised by the target tokens of the whole update over all ranks, known on the
        host (no sync); DDP averages gradients over ranks, so each rank scales its share by the world size.
        """
        tc = self.cfg.train
        n_tokens = global_tokens or sum(b.n_tgt_tokens for b in micro)
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro):
            batch = batch.to(self.device)
            last = i == len(micro) - 1
            sync = contextlib.nullcontext() if last or self.world == 1 else self._ddp().no_sync()
            with sync:  # accumulation micro-steps skip the gradient all-reduce
                with self.autocast():
                    logits = self.forward(batch.src, batch.tgt_in)  # (B, T, V)
                loss = label_smoothed_loss(logits, batch.tgt_out, tc.label_smoothing)
                self.scaler.scale(loss * (self.world / n_tokens)).backward()
            total += loss.detach()
        if tc.clip_norm > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total

    def _ddp(self) -> torch.nn.parallel.DistributedDataParallel:
        f = self.forward
        return getattr(f, "_orig_mod", f)  # under torch.compile, the wrapped DDP module

    # ------------------------------------------------------------------ validation and checkpoints

    @torch.no_grad()
    def validation_loss(self) -> float:
        """Label-smoothing-free cross-entropy per target token over the validation set."""
        self.model.eval()
        total, tokens = torch.zeros((), device=self.device), 0
        for b in make_batches(self.valid_data.src_lens[self.valid_idx], self.valid_data.tgt_lens[self.valid_idx],
                              self.cfg.train.max_tokens, seed=0, epoch=0, shuffle=False):
            batch = collate(self.valid_data, self.valid_idx[b]).to(self.device)
            with self.autocast():
                logits = self.model(batch.src, batch.tgt_in)
            total += label_smoothed_loss(logits, batch.tgt_out, 0.0)
            tokens += batch.n_tgt_tokens
        self.model.train()
        return total.item() / max(tokens, 1)

    def validation_bleu(self) -> dict[str, Any]:
        self.model.eval()
        translator = Translator(self.model, self.tokenizer, self.cfg.decode, self.device, self.precision)
        hyps = translator.translate(self.valid_text[0], beam=self.cfg.train.valid_beam)
        self.model.train()
        return score(hyps, self.valid_text[1])

    def validation_metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.valid_data is not None:
            metrics["loss"] = self.validation_loss()
            metrics["ppl"] = math.exp(min(metrics["loss"], 50.0))
            if self.valid_text is not None:
                metrics["bleu"] = self.validation_bleu()["bleu"]
        return metrics

    def validate_and_save(self, bar: Optional[tqdm] = None) -> bool:
        """Validate, write checkpoints (last, step_N, best), and say whether to stop early.

        Under DDP rank 0 does this while the others wait; every rank learns the early-stop decision.
        """
        rng = self._gathered_rng()
        stop = False
        if self.rank == 0:
            stop = self._validate_and_save(bar, rng)
        return self._agree(stop)[0]

    def _gathered_rng(self) -> Any:
        """This process's RNG states, or every rank's (a list) under DDP, for the checkpoint."""
        if self.world == 1:
            return rng_state()
        states: list[Any] = [None] * self.world
        dist.all_gather_object(states, rng_state())
        return states

    def _validate_and_save(self, bar: Optional[tqdm], rng: Any) -> bool:
        step, tc = self.state.step, self.cfg.train
        metrics = self.validation_metrics()
        for k, v in metrics.items():
            self.writer.add_scalar(f"valid/{k}", v, step)
        self.metrics = metrics
        current = metrics.get("bleu", -metrics.get("loss", -step))
        improved = current > self.state.best_score
        if improved:
            self.state.best_score, self.state.best_step, self.state.bad_validations = current, step, 0
        else:
            self.state.bad_validations += 1
        self.save(best=improved, rng=rng)
        msg = " ".join(f"{k} {v:.2f}" for k, v in metrics.items())
        (bar.write if bar else log.info)(f"step {step}: valid {msg or '(no validation set)'}"
                                         f"{' (best)' if improved else ''}")
        return bool(tc.patience) and self.state.bad_validations >= tc.patience

    def checkpoint_state(self, rng: Any = None) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.state.step,
            "train_state": {**dataclasses.asdict(self.state), "seconds": self.minutes() * 60},
            "metrics": self.metrics,
            "rng": rng if rng is not None else self._gathered_rng(),
            "config": self.cfg.to_dict(),
            "tokenizer": self.tokenizer.digest,
            "spm": {"src": self.tokenizer.src_bytes, "tgt": None if self.tokenizer.joint else self.tokenizer.tgt_bytes},
        }

    def save(self, best: bool = False, rng: Any = None) -> None:
        """step_N.pt (keep the newest train.keep_last), last.pt, and best.pt when improved."""
        ckpt_dir = self.run_dir / "checkpoints"
        state = self.checkpoint_state(rng)
        step_path = ckpt_dir / f"step_{self.state.step}.pt"
        save_checkpoint(ckpt_dir / "last.pt", state)
        if best:
            save_checkpoint(ckpt_dir / "best.pt", state)
        if self.cfg.train.keep_last > 0:
            save_checkpoint(step_path, state)
            for p in step_checkpoints(self.run_dir)[:-self.cfg.train.keep_last]:
                p.unlink(missing_ok=True)


def init_distributed(device: str) -> tuple[int, int, int]:
    """(rank, world size, local rank); joins the process group when launched by torchrun.

    NCCL on GPUs, gloo on CPU. A single process (plain `tmt train`) is rank 0 of 1.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and device in ("auto", "cuda")
        dist.init_process_group("nccl" if use_cuda else "gloo")
    if not dist.is_initialized():
        return 0, 1, 0
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))


def matmul_gflops(device: torch.device, precision: str, d_model: int, d_ff: int, seconds: float = 0.3) -> float:
    """Matmul GFLOP/s of the model's feed-forward shape in the training dtype: the MFU denominator."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    a = torch.full((4096, d_model), 0.5, device=device, dtype=dtype)  # no random numbers: resuming runs
    b = torch.full((d_model, d_ff), 0.5, device=device, dtype=dtype)  # must draw exactly what straight runs draw
    torch.mm(a, b)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        n += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2.0 * 4096 * d_model * d_ff * n / (time.perf_counter() - t0) / 1e9


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every random generator the loop touches, as plain data that weights_only loading accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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


def train(cfg: Config, resume: Optional[str | Path | bool] = None) -> dict[str, Any]:
    """Train a model as the config says; the run directory is cfg.output_dir."""
    return Trainer(cfg, resume).train()

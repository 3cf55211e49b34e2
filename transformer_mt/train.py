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
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .checkpoint import CheckpointError, average_checkpoints, load_checkpoint, save_checkpoint, step_checkpoints
from .config import Config, save_config
from .data import (Batch, DataError, TokenizedCorpus, collate, load_tokenized, make_batches, read_split,
                   usable_indices)
from .errors import UserError
from .evaluate import score
from .model import Transformer, build_model
from .tokenizer import PAD, Tokenizer, train_tokenizer
from .translate import Translator, pick_device

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


def resolve_precision(precision: str, device: torch.device) -> str:
    """auto: bf16 on GPUs that support it, fp16 (with a grad scaler) on older GPUs, fp32 elsewhere."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


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
        self.device = pick_device(tc.device)
        self.precision = resolve_precision(tc.precision, self.device)
        self.rank, self.world = 0, 1

        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        self.tokenizer = self._tokenizer()
        cache = Path(cfg.data.cache_dir) if cfg.data.cache_dir else self.run_dir / "cache"
        self.train_data = load_tokenized(cfg.data, "train", self.tokenizer, cache)
        self.train_idx = usable_indices(self.train_data, cfg.data.max_len, "train")
        self.valid_data: Optional[TokenizedCorpus] = None
        self.valid_text: Optional[tuple[list[str], list[str]]] = None
        if cfg.data.valid is not None:
            self.valid_data = load_tokenized(cfg.data, "valid", self.tokenizer, cache)
            self.valid_idx = usable_indices(self.valid_data, cfg.model.max_positions - 1, "valid")
            if tc.valid_bleu:
                self.valid_text = read_split(cfg.data, "valid")

        self.model: Transformer = build_model(cfg.model, self.tokenizer.src_vocab_size,
                                              self.tokenizer.tgt_vocab_size, self.tokenizer.joint).to(self.device)
        # torch.compile wraps the module for the training forward only; checkpoints take the state dict
        # of the plain module, so they load without compilation.
        self.forward = torch.compile(self.model, dynamic=True) if tc.compile else self.model
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
        set_rng_state(ckpt["rng"])
        log.info("resumed from %s: step %d, epoch %d, batch %d of the epoch", path, self.state.step,
                 self.state.epoch, self.state.batch_in_epoch)

    # ------------------------------------------------------------------ set-up helpers

    def _tokenizer(self) -> Tokenizer:
        """Reuse the run's SentencePiece model if there is one; otherwise train it on the train split."""
        if Tokenizer.exists(self.run_dir):
            return Tokenizer.load(self.run_dir)
        log.info("training SentencePiece (%s, %d pieces, %s) on the training split", self.cfg.tokenizer.type,
                 self.cfg.tokenizer.vocab_size, "joint" if self.cfg.tokenizer.joint else "separate")
        src, tgt = read_split(self.cfg.data, "train")
        if not src:
            raise DataError("data.train: the corpus is empty")
        tok = train_tokenizer(self.cfg.tokenizer, src, tgt, seed=self.cfg.train.seed)
        tok.save(self.run_dir)
        return tok

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of one epoch, as indices into the training corpus."""
        idx = self.train_idx
        batches = make_batches(self.train_data.src_lens[idx], self.train_data.tgt_lens[idx],
                               self.cfg.train.max_tokens, seed=self.cfg.train.seed, epoch=epoch)
        return [idx[b] for b in batches[self.rank::self.world]]

    def _batches(self) -> Iterator[Batch]:
        """Endless stream of training batches from the current position (epoch, batch_in_epoch)."""
        while self.state.epoch <= self.cfg.train.max_epochs:
            batches = self.epoch_batches(self.state.epoch)
            while self.state.batch_in_epoch < len(batches):
                b = batches[self.state.batch_in_epoch]
                self.state.batch_in_epoch += 1
                yield collate(self.train_data, b)
            self.state.epoch += 1
            self.state.batch_in_epoch = 0

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict[str, Any]:
        """Run until max_steps, max_epochs, the time budget or early stopping; return a summary."""
        tc = self.cfg.train
        from torch.utils.tensorboard import SummaryWriter  # imported late: slow, and only the loop needs it

        self.writer = SummaryWriter(str(self.run_dir / "tb"))
        log.info("device %s, precision %s, %.2fM parameters, %d training pairs, %d batches/epoch of <= %d tokens",
                 self.device, self.precision, self.model.num_parameters() / 1e6, len(self.train_idx),
                 len(self.epoch_batches(1)), tc.max_tokens)
        bar = tqdm(total=tc.max_steps, initial=self.state.step, desc="train", unit="step", dynamic_ncols=True,
                   mininterval=1.0)
        batches = self._batches()
        window_loss = torch.zeros((), device=self.device)
        window_tokens, window_start, window_first = 0, time.perf_counter(), self.state.step + 1
        validated_at, reason = -1, ""
        self.model.train()
        with self._stop_on_signals():
            while not reason:
                micro = [b for _, b in zip(range(tc.accumulate), batches)]
                if not micro:
                    reason = f"train.max_epochs={tc.max_epochs} reached"
                    break
                window_loss += self.train_step(micro)
                window_tokens += sum(b.n_tgt_tokens for b in micro)
                self.state.step += 1
                self.state.target_tokens += sum(b.n_tgt_tokens for b in micro)
                bar.update(1)
                step = self.state.step
                if step >= tc.max_steps:
                    reason = f"train.max_steps={tc.max_steps} reached"
                elif tc.max_minutes and self.minutes() >= tc.max_minutes:
                    reason = f"train.max_minutes={tc.max_minutes:g} reached"
                saving = step % tc.valid_every == 0 or reason or self.stop_signal
                if step % tc.log_every == 0 or saving:
                    loss = window_loss.item() / max(window_tokens, 1)  # the one host sync per window
                    if not math.isfinite(loss):
                        bar.close()
                        last = self.run_dir / "checkpoints" / "last.pt"
                        kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was written yet"
                        raise TrainingDiverged(
                            f"the training loss became {loss} between steps {window_first} and {step}; stopped, "
                            f"{kept} (lower train.lr_factor, raise train.warmup or set train.clip_norm)")
                if step % tc.log_every == 0:
                    now = time.perf_counter()
                    lr = self.scheduler.get_last_lr()[0]
                    tok_s = window_tokens / max(now - window_start, 1e-9)
                    bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}")
                    self.writer.add_scalar("train/loss", loss, step)
                    self.writer.add_scalar("train/lr", lr, step)
                    self.writer.add_scalar("train/tokens_per_sec", tok_s, step)
                    window_loss.zero_()
                    window_tokens, window_start, window_first = 0, now, step + 1
                if self.stop_signal and not reason:
                    bar.close()
                    save_checkpoint(self.run_dir / "checkpoints" / "last.pt", self.checkpoint_state())
                    self.writer.close()
                    raise TrainingInterrupted(
                        f"{self.stop_signal}: stopped after step {step}, saved {self.run_dir / 'checkpoints' / 'last.pt'}; "
                        "continue with the same command plus --resume",
                        130 if self.stop_signal == "SIGINT" else 143)
                if step % tc.valid_every == 0 or reason:
                    validated_at = step
                    if self.validate_and_save(bar) and not reason:
                        reason = f"no better validation score in train.patience={tc.patience} validations"
        if validated_at != self.state.step:
            self.validate_and_save(bar)  # keep the final weights too
        bar.close()
        log.info("stopped: %s", reason)
        if tc.average_last > 1:
            self.average_and_validate(tc.average_last)
        self.writer.close()
        return {"steps": self.state.step, "epochs": self.state.epoch, "minutes": round(self.minutes(), 2),
                "best_score": self.state.best_score, "best_step": self.state.best_step,
                "target_tokens": self.state.target_tokens, "stopped": reason, "run_dir": str(self.run_dir)}

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

    def train_step(self, micro: list[Batch]) -> torch.Tensor:
        """One optimizer update over `micro` batches; returns the summed loss (a device tensor)."""
        tc = self.cfg.train
        n_tokens = sum(b.n_tgt_tokens for b in micro)  # known on the host: no sync to normalise
        total = torch.zeros((), device=self.device)
        for batch in micro:
            batch = batch.to(self.device)
            with self.autocast():
                logits = self.forward(batch.src, batch.tgt_in, batch.positions)  # (N, V): real tokens only
            loss = label_smoothed_loss(logits, batch.targets, tc.label_smoothing)
            self.scaler.scale(loss / n_tokens).backward()
            total += loss.detach()
        if tc.clip_norm > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total

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
                logits = self.model(batch.src, batch.tgt_in, batch.positions)
            total += label_smoothed_loss(logits, batch.targets, 0.0)
            tokens += batch.n_tgt_tokens
        self.model.train()
        return total.item() / max(tokens, 1)

    def validation_bleu(self) -> dict[str, Any]:
        self.model.eval()
        translator = Translator(self.model, self.tokenizer, self.cfg.decode, self.device)
        with self.autocast():
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
        """Validate, write checkpoints (last, step_N, best), and say whether to stop early."""
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
        self.save(best=improved)
        msg = " ".join(f"{k} {v:.2f}" for k, v in metrics.items())
        (bar.write if bar else log.info)(f"step {step}: valid {msg or '(no validation set)'}"
                                         f"{' (best)' if improved else ''}")
        return bool(tc.patience) and self.state.bad_validations >= tc.patience

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.state.step,
            "train_state": {**dataclasses.asdict(self.state), "seconds": self.minutes() * 60},
            "metrics": self.metrics,
            "rng": rng_state(),
            "config": self.cfg.to_dict(),
            "tokenizer": self.tokenizer.digest,
        }

    def save(self, best: bool = False) -> None:
        """step_N.pt (keep the newest train.keep_last), last.pt, and best.pt when improved."""
        ckpt_dir = self.run_dir / "checkpoints"
        state = self.checkpoint_state()
        step_path = ckpt_dir / f"step_{self.state.step}.pt"
        save_checkpoint(ckpt_dir / "last.pt", state)
        if best:
            save_checkpoint(ckpt_dir / "best.pt", state)
        if self.cfg.train.keep_last > 0:
            save_checkpoint(step_path, state)
            for p in step_checkpoints(self.run_dir)[:-self.cfg.train.keep_last]:
                p.unlink(missing_ok=True)


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

"""Self-describing checkpoints: written atomically, loaded with `weights_only=True`.

A checkpoint is a dict with `model` (state dict of the uncompiled module), `optimizer`,
`scheduler`, `step`, `config` (the resolved config as plain data), `tokenizer` (hash of the
SentencePiece models), `spm` (the models themselves, so a copied checkpoint still translates),
`version`, `metrics` (validation of this very step; empty when it was not validated), `rng`,
`train_state` (the loop's resumable state) and, in a fine-tuned run (`--init-from`), `parent` (the
path, step and tokenizer digest of the checkpoint it started from).

Everything about the format lives here: building the dict, saving and rotating, the checks a
resume makes, loading for inference, and averaging.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from . import __version__
from .config import Config, config_from_dict
from .errors import UserError
from .fileio import atomic_write
from .model import Transformer
from .tokenizer import Tokenizer

log = logging.getLogger("transformer_mt")

REQUIRED_KEYS = ("model", "config", "step")


class CheckpointError(UserError):
    """A checkpoint path that does not exist, is not a checkpoint, or does not match its
    tokenizer."""


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """torch.save streamed into a temporary file beside `path` (no copy of the checkpoint in
    memory), fsync, then rename over it."""
    try:
        atomic_write(path, lambda f: torch.save({**state, "version": __version__}, f))
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint {path}: {e.strerror or e}; the previous file at that path is "
            "intact"
        ) from None


def copy_checkpoint(src: Path, dst: Path) -> None:
    """dst becomes the file src is, atomically: a hard link renamed over dst (no bytes written) or,
    where the file system has no hard links, a copy written and renamed like a save. Every save
    renames a new file over its path, so names linked to one file never change together."""
    tmp = dst.with_name(f".{dst.name}.link{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        os.link(src, tmp)
        os.replace(tmp, dst)
        return
    except OSError:  # no hard links here (some network and FAT file systems): copy
        tmp.unlink(missing_ok=True)
    try:
        with open(src, "rb") as f:
            atomic_write(dst, lambda out: shutil.copyfileobj(f, out, 1 << 20))
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint {dst}: {e.strerror or e}; the previous file at that path is "
            "intact"
        ) from None


def resume_path(run_dir: Path, resume: str | Path | bool | None) -> Path | None:
    """The checkpoint to resume from; refuses to start over a run that has checkpoints, and to
    train one model into an ensemble's run directory."""
    if members := ensemble_members(run_dir):
        raise UserError(
            f"{run_dir} holds an ensemble of {len(members)} models (members/): resume it with its "
            "own config (train.ensemble), or set another output_dir"
        )
    last = run_dir / "checkpoints" / "last.pt"
    if resume is None or resume is False:
        if last.exists():
            raise UserError(
                f"{run_dir} already holds a run (checkpoints/last.pt): add --resume to continue "
                "it, or set another output_dir (or delete the folder) to start over"
            )
        return None
    path = last if resume is True else Path(resume)
    if not path.is_file():
        raise CheckpointError(f"cannot resume: checkpoint not found: {path}")
    return path


def weights_only_error(path: Path) -> CheckpointError:
    """The resume of a checkpoint without training state (an average), naming the file that
    resumes."""
    last = run_dir_of(path) / "checkpoints" / "last.pt"
    return CheckpointError(
        f"cannot resume from {path}: it holds weights only (an averaged checkpoint; best.pt and "
        f"averaged.pt are after averaging): resume from {last}"
    )


def load_training_checkpoint(
    path: Path, map_location: str | torch.device = "cpu"
) -> dict[str, Any]:
    """A checkpoint to resume from: loaded, and refused at once (before any set-up) if it holds
    weights only."""
    ckpt = load_checkpoint(path, map_location=map_location)
    if "optimizer" not in ckpt or "train_state" not in ckpt:
        raise weights_only_error(path)
    return ckpt


def load_checkpoint(
    path: str | os.PathLike, map_location: str | torch.device = "cpu"
) -> dict[str, Any]:
    """Load with weights_only=True: a crafted pickle cannot run code, it is refused."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    # the weights-only unpickler raises many types for files that are not checkpoints
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} is not a loadable transformer-mt checkpoint (refused by "
            f"torch.load(weights_only=True): {first[:200]})"
        ) from None
    if not isinstance(ckpt, dict) or any(k not in ckpt for k in REQUIRED_KEYS):
        raise CheckpointError(
            f"{path} is not a transformer-mt checkpoint (it lacks {', '.join(REQUIRED_KEYS)})"
        )
    return ckpt


def ensemble_members(run_dir: str | os.PathLike) -> list[Path]:
    """The member run directories of an ensemble run (`train.ensemble` > 1: RUN/members/1, 2, …),
    in order; [] for any other directory."""
    root = Path(run_dir) / "members"
    if not root.is_dir():
        return []
    members = [p for p in root.iterdir() if p.is_dir() and p.name.isdigit()]
    return sorted(members, key=lambda p: int(p.name))


def _newest_run(runs_dir: str | os.PathLike) -> Path:
    """The most recently trained run directory under runs_dir (a single model or an ensemble)."""
    runs_dir = Path(runs_dir)
    # (last.pt, its run directory): a single model's, or an ensemble member's
    lasts = [(p, p.parents[1]) for p in runs_dir.glob("*/checkpoints/last.pt")]
    lasts += [(p, p.parents[3]) for p in runs_dir.glob("*/members/*/checkpoints/last.pt")]
    if not lasts:
        raise CheckpointError(
            f"no trained run found under {runs_dir.resolve()}: train one with `tmt train "
            "CONFIG`, or pass --checkpoint RUN_DIR_OR_FILE"
        )
    return max(lasts, key=lambda found: found[0].stat().st_mtime)[1]


def resolve_checkpoints(
    path: str | os.PathLike | None, runs_dir: str | os.PathLike = "runs"
) -> list[Path]:
    """Like resolve_checkpoint, but an ensemble run's directory gives each member's checkpoint."""
    run = _newest_run(runs_dir) if path is None else Path(path)
    members = ensemble_members(run) if run.is_dir() else []
    found = [resolve_checkpoint(m) for m in members] if members else [resolve_checkpoint(run)]
    if path is None:
        print(f"tmt: using checkpoint {', '.join(map(str, found))}", file=sys.stderr)
    return found


def resolve_checkpoint(
    path: str | os.PathLike | None, runs_dir: str | os.PathLike = "runs"
) -> Path:
    """A checkpoint file, a run directory (its best, else last, checkpoint), or — when None —
    the best checkpoint of the most recently trained run under ./runs/. One model: an ensemble
    run's directory is refused (resolve_checkpoints takes it)."""
    if path is None:
        found = resolve_checkpoint(_newest_run(runs_dir))
        print(f"tmt: using checkpoint {found}", file=sys.stderr)
        return found
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        for candidate in (
            path / "checkpoints" / "best.pt",
            path / "checkpoints" / "last.pt",
            path / "best.pt",
            path / "last.pt",
        ):
            if candidate.is_file():
                return candidate
        members = ensemble_members(path)
        if members:
            raise CheckpointError(
                f"{path} is an ensemble of {len(members)} models, and this takes one: pass one "
                f"member's run directory (e.g. {members[0]})"
            )
        raise CheckpointError(
            f"{path} is a directory with no checkpoints/best.pt or checkpoints/last.pt"
        )
    raise CheckpointError(f"checkpoint not found: {path}")


def run_dir_of(checkpoint_path: Path) -> Path:
    """The run directory holding a checkpoint (…/RUN/checkpoints/x.pt -> …/RUN)."""
    parent = checkpoint_path.resolve().parent
    return parent.parent if parent.name == "checkpoints" else parent


def load_for_inference(
    path: Path, device: torch.device | str = "cpu"
) -> tuple[Transformer, Tokenizer, Config, dict[str, Any]]:
    """Model (eval mode, on `device`), its tokenizer and config, from a checkpoint file."""
    ckpt = load_checkpoint(path)
    cfg = config_from_dict(ckpt["config"], source=f"{path} (saved config)")
    tokenizer = checkpoint_tokenizer(ckpt, path)
    model = Transformer(
        cfg.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint
    )
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise CheckpointError(
            f"{path}: weights do not match the saved model config: {str(e).splitlines()[0]}"
        ) from None
    return model.to(device).eval(), tokenizer, cfg, ckpt


def checkpoint_tokenizer(ckpt: dict[str, Any], path: Path) -> Tokenizer:
    """The SentencePiece model(s) a checkpoint was trained with: its run directory's, else the
    copies it carries; checked against the digest it records."""
    run_dir = run_dir_of(path)
    if Tokenizer.exists(run_dir):
        tokenizer = Tokenizer.load(run_dir)
    # a checkpoint copied away from its run carries its SentencePiece model(s)
    elif ckpt.get("spm"):
        tokenizer = Tokenizer(ckpt["spm"]["src"], ckpt["spm"].get("tgt"))
    else:
        raise CheckpointError(
            f"no SentencePiece model beside {path} (spm.model in {run_dir}), and the checkpoint "
            "carries none: copy the run's spm*.model files next to it"
        )
    check_tokenizer(ckpt, tokenizer, path, run_dir)
    return tokenizer


def check_tokenizer(
    ckpt: dict[str, Any], tokenizer: Tokenizer, path: Path, run_dir: Path, *, resuming: bool = False
) -> None:
    """The checkpoint must have been trained with this SentencePiece model. Old checkpoints that
    name none still translate; a resume needs the match proven."""
    saved = ckpt.get("tokenizer")
    if saved != tokenizer.digest and (resuming or saved is not None):
        raise CheckpointError(
            f"{'cannot resume from ' if resuming else ''}{path}: it was trained with tokenizer "
            f"{saved}, but the SentencePiece model in {run_dir} is {tokenizer.digest}: they do not "
            "belong together"
        )


def model_differences(ckpt: dict[str, Any], cfg: Config, ignore: tuple[str, ...] = ()) -> list[str]:
    """`model.KEY: checkpoint X, config Y` for each model key (but `ignore`) on which the
    checkpoint's saved config and `cfg` differ."""
    saved = ckpt["config"].get("model", {})
    return [
        f"model.{k}: checkpoint {saved.get(k)!r}, config {v!r}"
        for k, v in dataclasses.asdict(cfg.model).items()
        if k not in ignore and saved.get(k) != v
    ]


# Model keys a fine-tuning run may change: they regularise training and leave the weights' shapes.
FINE_TUNABLE_KEYS = ("dropout", "attention_dropout", "activation_dropout")


@dataclasses.dataclass(frozen=True)
class Parent:
    """The checkpoint a fine-tuning run (`tmt train --init-from`) starts from: its weights, its
    SentencePiece model(s) and saved config."""

    path: Path
    step: int
    tokenizer: Tokenizer
    weights: dict[str, Any]
    config: Config

    def record(self) -> dict[str, Any]:
        """What the new run keeps of its parent: config.yaml's header, parent.json, checkpoints."""
        return {"path": str(self.path), "step": self.step, "tokenizer": self.tokenizer.digest}


def load_parent(init_from: str | os.PathLike, cfg: Config) -> Parent:
    """The run or checkpoint `--init-from` names (a run directory: its best, else last,
    checkpoint), refused when it cannot start `cfg`'s model: the model sections must agree (but
    dropout)."""
    path = resolve_checkpoint(init_from).resolve()
    ckpt = load_checkpoint(path)
    diff = model_differences(ckpt, cfg, ignore=FINE_TUNABLE_KEYS)
    if diff:
        raise CheckpointError(
            f"cannot fine-tune from {path}: the model config differs: "
            + "; ".join(diff)
            + " (the model section must be the parent's; only dropout may change)"
        )
    saved = config_from_dict(ckpt["config"], source=f"{path} (saved config)")
    tokenizer = checkpoint_tokenizer(ckpt, path)
    return Parent(path, int(ckpt["step"]), tokenizer, ckpt["model"], saved)


def start_from(
    run_dir: Path, resume: str | Path | bool | None, init_from: Any, cfg: Config
) -> tuple[Path | None, Parent | None]:
    """Where a run starts: the checkpoint it resumes from, or the parent it is fine-tuned from
    (neither: from scratch). A directory that holds a run is refused unless resumed."""
    if init_from and resume is not None and resume is not False:
        raise UserError(
            "--init-from and --resume do not go together: --init-from starts a new run from "
            "another run's weights; --resume continues this run exactly where it stopped"
        )
    parent = load_parent(init_from, cfg) if init_from else None
    return resume_path(run_dir, resume), parent


def check_resumable(
    ckpt: dict[str, Any], path: Path, cfg: Config, tokenizer: Tokenizer, run_dir: Path
) -> None:
    """A resume continues the same model with the same tokenizer, from a full training
    checkpoint."""
    check_tokenizer(ckpt, tokenizer, path, run_dir, resuming=True)
    diff = model_differences(ckpt, cfg)
    if diff:
        raise CheckpointError(
            f"cannot resume from {path}: the model config differs: " + "; ".join(diff)
        )
    if "optimizer" not in ckpt or "train_state" not in ckpt:
        raise weights_only_error(path)


def restore_training(
    path: Path,
    *,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    cfg: Config,
    tokenizer: Tokenizer,
    run_dir: Path,
    device: torch.device,
    ckpt: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a training checkpoint (or take `ckpt`, already loaded from `path`) into the model,
    optimizer, schedule and grad scaler, after the resume checks; returns it (the caller restores
    its train_state and rng)."""
    ckpt = ckpt if ckpt is not None else load_checkpoint(path, map_location=device)
    check_resumable(ckpt, path, cfg, tokenizer, run_dir)
    model.load_state_dict(ckpt["model"])
    saved, groups = len(ckpt["optimizer"]["param_groups"]), len(optimizer.param_groups)
    if saved != groups:  # build_optimizer makes a second group only to spare the 1-D weights
        raise CheckpointError(
            f"cannot resume from {path}: its Adam has {saved} parameter group(s), this config's "
            f"{groups}: train.decay_norms_and_biases (with train.weight_decay) must stay as the "
            "run began"
        )
    # Adam's state carries over; how it runs (fused or foreach) stays this machine's choice.
    implementation = [{k: g.get(k) for k in ("fused", "foreach")} for g in optimizer.param_groups]
    optimizer.load_state_dict(ckpt["optimizer"])
    for group, chosen in zip(optimizer.param_groups, implementation):
        group.update(chosen)
    scheduler.load_state_dict(ckpt["scheduler"])
    scaler.load_state_dict(ckpt.get("scaler", {}))
    state = ckpt["train_state"]
    log.info(
        "resumed from %s: step %d, epoch %d, batch %d of the epoch",
        path,
        state["step"],
        state["epoch"],
        state["batch_in_epoch"],
    )
    return ckpt


def training_checkpoint(
    *,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    train_state: dict[str, Any],
    metrics: dict[str, float],
    rng: Any,
    cfg: Config,
    tokenizer: Tokenizer,
    parent: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything a resume needs, and everything translate needs without the run directory; a
    fine-tuned run's `parent` (Parent.record)."""
    return {
        **({"parent": parent} if parent else {}),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "step": train_state["step"],
        "train_state": train_state,
        "metrics": metrics,
        "rng": rng,
        "config": cfg.to_dict(),
        "tokenizer": tokenizer.digest,
        "spm": {
            "src": tokenizer.src_bytes,
            "tgt": None if tokenizer.joint else tokenizer.tgt_bytes,
        },
    }


def save_rotating(run_dir: Path, state: dict[str, Any], *, best: bool, keep_last: int) -> None:
    """last.pt, best.pt when improved, and step_N.pt keeping the newest `keep_last` of them:
    serialised once, into last.pt; the others are hard links to (or copies of) that file."""
    ckpt_dir = run_dir / "checkpoints"
    last = ckpt_dir / "last.pt"
    save_checkpoint(last, state)
    if best:
        copy_checkpoint(last, ckpt_dir / "best.pt")
    if keep_last > 0:
        copy_checkpoint(last, ckpt_dir / f"step_{state['step']}.pt")
        for p in step_checkpoints(run_dir)[:-keep_last]:
            p.unlink(missing_ok=True)


def step_of(path: Path) -> int:
    """N of a step_N.pt file."""
    return int(path.stem.split("_")[1])


def step_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The run's checkpoints/step_N.pt files, oldest first."""
    return sorted(Path(run_dir, "checkpoints").glob("step_*.pt"), key=step_of)


def validation_score(metrics: dict[str, float]) -> float | None:
    """What "better" means for checkpoints: validation BLEU, else minus the loss; None if not
    validated."""
    if "bleu" in metrics:
        return metrics["bleu"]
    if "loss" in metrics:
        return -metrics["loss"]
    return None


def average_checkpoints(paths: list[Path]) -> dict[str, Any]:
    """Element-wise mean of the weights of several checkpoints (Sec. 6.1 averages the last 5).

    The result keeps the newest checkpoint's config, tokenizer and step, but no optimizer state.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    steps = []
    for path in paths:
        ckpt = load_checkpoint(path)
        steps.append(ckpt["step"])
        for k, v in ckpt["model"].items():
            if k in total and total[k].shape != v.shape:
                raise CheckpointError(
                    f"{path}: {k} has shape {tuple(v.shape)}, not {tuple(total[k].shape)}: these "
                    "checkpoints are not of one model"
                )
            total[k] = total[k] + v.double() if k in total else v.double()
    model = {k: (v / len(paths)).to(ckpt["model"][k].dtype) for k, v in total.items()}
    keep = {k: ckpt[k] for k in ("config", "tokenizer", "spm", "step", "parent") if k in ckpt}
    return {**keep, "model": model, "averaged_steps": steps}


def _validated_scores(paths: list[Path]) -> dict[Path, float]:
    """The step checkpoints that were validated at their own step, with their scores.

    A checkpoint written between validations (train.save_every) carries no metrics of its own, so it
    is not ranked: its weights were never scored.
    """
    scores = {}
    for path in paths:
        score = validation_score(load_checkpoint(path).get("metrics") or {})
        if score is not None:
            scores[path] = score
    return scores


def average_run(
    run_dir: str | os.PathLike,
    *,
    last: int = 0,
    best: int = 0,
    output: str | os.PathLike | None = None,
    validate: Callable[[dict[str, Any]], dict[str, float]] | None = None,
) -> tuple[Path, list[int]]:
    """`tmt average`: average the newest `last` (or the `best` best-validating) step checkpoints.
    `validate` (the end of a training run) scores the averaged checkpoint; its metrics are saved in
    it."""
    paths = step_checkpoints(run_dir)
    n = last or best
    if not paths and (members := ensemble_members(run_dir)):
        raise CheckpointError(
            f"{Path(run_dir)} is an ensemble of {len(members)} models: average one member's "
            f"checkpoints (e.g. tmt average {members[0]})"
        )
    if len(paths) < 2 or n < 2:
        raise CheckpointError(
            f"{Path(run_dir)}: need at least 2 step_N.pt checkpoints to average (found "
            f"{len(paths)}; keep more with train.keep_last)"
        )
    if last:
        chosen = paths[-n:]
    else:
        scores = _validated_scores(paths)
        if len(scores) < 2:
            raise CheckpointError(
                f"{Path(run_dir)}: --best needs at least 2 validated step checkpoints, found "
                f"{len(scores)} of {len(paths)} (steps between validations are not scored): use "
                "--last instead of --best"
            )
        if len(scores) < n:
            log.warning(
                "--best %d: only %d of the %d step checkpoints were validated; averaging those",
                n,
                len(scores),
                len(paths),
            )
        chosen = sorted(sorted(scores, key=scores.get)[-n:], key=step_of)
    averaged = average_checkpoints(chosen)
    if validate is not None:
        averaged["metrics"] = validate(averaged)
    out = Path(output) if output else Path(run_dir, "checkpoints", "averaged.pt")
    save_checkpoint(out, averaged)
    return out, averaged["averaged_steps"]


def average_last(
    run_dir: Path,
    n: int,
    validate: Callable[[dict[str, Any]], dict[str, float]],
    best_score: float,
) -> float | None:
    """At the end of training (train.average_last): average the newest n step checkpoints into
    averaged.pt (average_run), with the metrics `validate` gives its weights; it becomes best.pt if
    it validates better than `best_score`. Its score if it did, else None."""
    found = len(step_checkpoints(run_dir)[-n:])
    if found < 2:
        log.warning(
            "train.average_last=%d: only %d step checkpoint(s) to average; skipped", n, found
        )
        return None
    metrics: dict[str, float] = {}
    path, steps = average_run(
        run_dir, last=n, validate=lambda w: metrics.update(validate(w)) or metrics
    )
    current = validation_score(metrics)
    better = current is not None and current > best_score
    if better:
        copy_checkpoint(path, path.with_name("best.pt"))  # serialised once
    log.info(
        "averaged %d checkpoints (steps %s): valid %s%s",
        len(steps),
        ", ".join(map(str, steps)),
        " ".join(f"{k} {v:.2f}" for k, v in metrics.items()),
        " (best: now best.pt)" if better else "",
    )
    return current if better else None

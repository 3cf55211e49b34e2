"""Training an ensemble (`train.ensemble: N`): N models at once, each in its own process with its
own seed, on its own share of the CPU's cores (or all on the one GPU), all with the run's
SentencePiece model. translate/evaluate given the run directory decode with all of them, averaging
their next-token distributions (model.Ensemble).

Why processes and not one model with all the threads: a model as small as the Multi30k recipe's
makes more of one core than of two (docs/multi30k.md measures both), and independent models decode
better together than any one of them alone. The run directory:

    RUN/config.yaml, RUN/spm.model   the ensemble's config and its one SentencePiece model
    RUN/members/1 … RUN/members/N    each a run directory of its own: config.yaml (its seed and
                                     threads), checkpoints/, tb/ and train.log (its output)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .checkpoint import CheckpointError, ensemble_members, resume_path
from .config import Config, ConfigError, config_from_dict, save_config
from .data import prepare_data, prepare_tokenizer, read_split
from .errors import TrainingInterrupted, UserError
from .fileio import atomic_write
from .inference import load_translator
from .metrics import score
from .runtime import SignalScope

log = logging.getLogger("transformer_mt")
_READY = -1  # a member's gate once it takes signals itself (signal numbers are > 0)


class MemberFailed(UserError):
    """A member's process ended with an error; its train.log has the traceback."""


def member_config(cfg: Config, index: int, threads: int) -> Config:
    """Member `index` (from 1): the run's config as one model, with seed train.seed + index - 1
    (member 1 trains what the config alone would), its thread count and its directory."""
    train = dataclasses.replace(
        cfg.train, ensemble=1, seed=cfg.train.seed + index - 1, threads=threads
    )
    out = Path(cfg.output_dir) / "members" / str(index)
    return dataclasses.replace(cfg, train=train, output_dir=str(out))


def core_shares(n: int) -> list[list[int]] | None:
    """This process's CPU cores cut into n equal, disjoint shares, one per member (the remainder
    unused); None where they cannot be (fewer cores than members, or no affinity on this OS)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    k = len(cores) // n
    return [cores[i * k : (i + 1) * k] for i in range(n)] if k else None


def _member_threads(cfg: Config, shares: list[list[int]] | None) -> int:
    """Intra-op threads of each member: train.threads when set, else its share of the cores."""
    if cfg.train.threads:
        return cfg.train.threads
    if shares:
        return len(shares[0])
    return max(1, (os.cpu_count() or 1) // cfg.train.ensemble)


def train_ensemble(cfg: Config, resume: bool = False) -> dict[str, Any]:
    """Train the config's `train.ensemble` members side by side (with `resume`, each from its own
    last.pt; a member without one starts afresh), then validate them together; a summary of the
    run. SIGINT/SIGTERM reach every member, which finishes its step and writes last.pt, as a single
    run does; a member that fails stops the others."""
    n, run_dir, started = cfg.train.ensemble, Path(cfg.output_dir), time.time()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            f"train.ensemble: {n} trains its members as processes of its own; run it without "
            "torchrun (or set train.ensemble: 1 for data-parallel training)"
        )
    if (run_dir / "checkpoints" / "last.pt").exists():
        raise UserError(
            f"{run_dir} holds a run of one model (checkpoints/last.pt): set another output_dir "
            "for the ensemble (or delete the folder)"
        )
    if (on_disk := ensemble_members(run_dir)) and int(on_disk[-1].name) > n:
        raise ConfigError(
            f"train.ensemble: {n}, but {run_dir} holds {int(on_disk[-1].name)} members: set it "
            f"back to {int(on_disk[-1].name)}, or set another output_dir"
        )
    shares = core_shares(n) if cfg.train.device in ("auto", "cpu") else None
    threads = _member_threads(cfg, shares)
    members = [member_config(cfg, i + 1, threads) for i in range(n)]
    lasts = [Path(m.output_dir) / "checkpoints" / "last.pt" for m in members]
    if not resume:  # before anything is written: never start over a member's checkpoints
        for m in members:
            resume_path(Path(m.output_dir), None)
    elif not any(last.exists() for last in lasts):
        raise CheckpointError(f"cannot resume: no member of {run_dir} has a checkpoints/last.pt")
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    tokenizer = prepare_tokenizer(cfg, run_dir)  # once, for every member
    prepare_data(cfg, tokenizer)  # the token cache, filled once: the members read it
    for m in members:
        Path(m.output_dir).mkdir(parents=True, exist_ok=True)
        tokenizer.save(m.output_dir)
    resumes = [resume and last.exists() for last in lasts]
    log.info(
        "ensemble of %d: members in %s/members/ (seeds %s), %d thread%s each%s; each member's "
        "output goes to its train.log%s",
        n,
        run_dir,
        ", ".join(str(m.train.seed) for m in members),
        threads,
        "" if threads == 1 else "s",
        f", on cores {' | '.join(','.join(map(str, s)) for s in shares)}" if shares else "",
        "".join(
            f"; member {i + 1} has no last.pt: it starts afresh"
            for i, r in enumerate(resumes)
            if resume and not r
        ),
    )
    summaries = _run_members(members, shares, resumes, started)
    return _summary(cfg, run_dir, summaries)


def _run_members(
    members: list[Config], shares: list[list[int]] | None, resumes: list[bool], started: float
) -> list[dict[str, Any]]:
    """Start one process per member, show their progress in one bar, pass signals on, and wait;
    each member's summary, in order. `started` (time.time()) is when the ensemble's set-up began:
    each member's time budget counts from there. A member that fails stops the others."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold CUDA or threads
    progress = ctx.Array("q", 2 * len(members), lock=False)  # (step, planned last step) each
    # Each member's signal gate: 0 while it boots, READY once its handlers are in place, or the
    # signal the parent had for it before then (a signal that early would kill it without a trace).
    gates = ctx.Array("i", len(members))
    dirs = [Path(m.output_dir) for m in members]
    logs = [d / "train.log" for d in dirs]
    seen = [p.stat().st_size if p.is_file() else 0 for p in logs]  # this run's part of each log
    for d in dirs:
        (d / "summary.json").unlink(missing_ok=True)
    procs = [
        ctx.Process(
            target=_member_main,
            args=(
                i,
                m.to_dict(),
                resumes[i],
                started,
                os.getpid(),
                shares[i] if shares else None,
                progress,
                gates,
            ),
            name=f"tmt-member-{i + 1}",
        )
        for i, m in enumerate(members)
    ]
    bar = tqdm(
        desc=f"ensemble of {len(members)}",
        unit="step",
        dynamic_ncols=True,
        disable=log.level > logging.INFO,  # tmt -q
    )
    forwarded = _Forwarded(procs, gates)
    try:
        with forwarded:
            for p in procs:  # a signal meanwhile waits at the gates of those not yet booted
                p.start()
            failed = _watch(procs, forwarded, progress, bar)
    finally:
        bar.close()
        for p in procs:  # on our own error: members write last.pt and stop, not train on unseen
            if p.is_alive():
                p.terminate()
            if p.pid is not None:
                p.join()
    if failed:
        i = failed[0]
        tail = []
        if logs[i].is_file():  # (a member that failed before opening it: its error went to ours)
            with open(logs[i], "rb") as f:
                f.seek(seen[i])
                tail = f.read().decode("utf-8", errors="replace").replace("\r", "\n").splitlines()
        raise MemberFailed(
            f"ensemble member {i + 1} failed (exit code {procs[i].exitcode}); the end of "
            f"{logs[i]}:\n" + "\n".join(line for line in tail if line.strip())[-2000:]
        )
    codes = [p.exitcode for p in procs]
    if any(c in (130, 143) for c in codes):
        raise TrainingInterrupted(
            f"{forwarded.caught or 'signal'}: each member stopped, with its last.pt written if it "
            "had begun training; continue with the same command plus --resume",
            143 if 143 in codes else 130,
        )
    return [json.loads((d / "summary.json").read_text()) for d in dirs]


def _watch(procs: list[Any], forwarded: _Forwarded, progress: Any, bar: tqdm) -> list[int]:
    """Until every member has ended: their steps in the bar; the first to fail stops the others.
    The members that failed (not 0, nor a signal's 130/143)."""
    failed: list[int] = []
    waiting = {p.sentinel: i for i, p in enumerate(procs)}
    while waiting:
        for done in multiprocessing.connection.wait(list(waiting), timeout=1.0):
            i = waiting.pop(done)
            procs[i].join()
            if procs[i].exitcode in (0, 130, 143):
                continue
            failed.append(i)
            if len(failed) == 1 and waiting:
                log.error(
                    "ensemble member %d failed (exit code %s): stopping the others",
                    i + 1,
                    procs[i].exitcode,
                )
                forwarded.forward(signal.SIGTERM)
        steps = [progress[2 * i] for i in range(len(procs))]
        bar.total = sum(progress[2 * i + 1] for i in range(len(procs))) or None
        bar.n = sum(steps)
        bar.set_postfix(steps=" ".join(f"{s:,}" for s in steps), refresh=True)
    return failed


class _Forwarded(SignalScope):
    """While members train: SIGINT/SIGTERM to this process go on to every member (each runs in a
    session of its own, so a terminal's Ctrl-C reaches it once, through here). A member still
    booting gets it through its gate instead, and acts on it once it can."""

    def __init__(self, procs: list[Any], gates: Any):
        self.procs, self.gates, self.caught = procs, gates, None

    def handler(self, signum: int, frame: Any) -> None:
        self.caught = signal.Signals(signum).name
        self.forward(signum)

    def forward(self, signum: int) -> None:
        for i, p in enumerate(self.procs):
            with self.gates.get_lock():  # the member opens its gate under the same lock
                if self.gates[i] != _READY:
                    self.gates[i] = signum
                elif p.pid is not None and p.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signum)


def _member_main(
    index: int,
    cfg_dict: dict[str, Any],
    resume: bool,
    started: float,
    parent: int,
    cores: list[int] | None,
    progress: Any,
    gates: Any,
) -> None:
    """A member's process: its own session, cores and train.log, then the training loop of a single
    run; its summary to summary.json. It stops (writing last.pt) if the parent goes away."""
    early: list[int] = []  # a signal before the loop's own handler is in place: acted on below
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, frame: early.append(signum))
    with gates.get_lock():  # from here on the parent signals us; what it sent before, we take
        if gates[index]:
            early.append(gates[index])
        gates[index] = _READY
    if hasattr(os, "setsid"):
        os.setsid()  # signals come through the parent, once
    cfg = config_from_dict(cfg_dict, source=f"ensemble member {index + 1}")
    run_dir = Path(cfg.output_dir)
    out = open(run_dir / "train.log", "a", buffering=1, encoding="utf-8")
    for fd in (1, 2):  # native libraries' output too
        os.dup2(out.fileno(), fd)
    sys.stdout = sys.stderr = out
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("tmt: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    _stop_when_orphaned(parent)
    if cores:
        os.sched_setaffinity(0, cores)
    from .train import Trainer  # here: after the signals, session and output are set

    before = time.time()
    trainer = Trainer(cfg, resume=resume or None)
    trainer.started -= before - started  # the ensemble's set-up counts in the time budget
    trainer.signal_grace = 1.0  # signalled directly and through the parent: one request

    def report(step: int, total: int) -> None:
        progress[2 * index], progress[2 * index + 1] = step, total
        if early:  # now the loop's handler is in place: it finishes this step and saves
            os.kill(os.getpid(), early.pop())

    trainer.on_update = report
    if early:
        log.info("%s before training began: stopped", signal.Signals(early[0]).name)
        sys.exit(143 if early[0] == signal.SIGTERM else 130)
    try:
        summary = trainer.train()
    except TrainingInterrupted as e:
        log.info("%s", e)
        sys.exit(e.exit_code)
    atomic_write(run_dir / "summary.json", (json.dumps(summary, indent=1) + "\n").encode())


def _stop_when_orphaned(parent: int) -> None:
    """If the parent dies (even by SIGKILL), SIGTERM this member: it writes last.pt and stops
    rather than train on unseen."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(2.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="orphan-watch").start()


def _summary(cfg: Config, run_dir: Path, members: list[dict[str, Any]]) -> dict[str, Any]:
    """The members' summaries and, with a validation split, the ensemble's validation BLEU
    (decoded as training validates: train.valid_beam); also written to RUN/ensemble.json."""
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "rank": 0,
        "members": members,
        "steps": [m["steps"] for m in members],
        "minutes": max(m["minutes"] for m in members),
        "stopped": "; ".join(sorted({m["stopped"] for m in members})),
    }
    if cfg.data.valid and cfg.train.valid_bleu:
        translator = load_translator(run_dir, device=cfg.train.device, beam=cfg.train.valid_beam)
        sources, refs = read_split(cfg.data, "valid")
        hyps = translator.translate_text(sources)
        summary["valid_bleu"] = score(hyps, refs, names=("bleu",), lang=cfg.data.tgt_lang)["bleu"]
        log.info(
            "ensemble of %d (%s): validation BLEU %.2f; the members alone: %s",
            len(members),
            ", ".join(str(p) for p in translator.members),
            summary["valid_bleu"],
            ", ".join(
                "-" if m["best_score"] is None else f"{m['best_score']:.2f}" for m in members
            ),
        )
    atomic_write(run_dir / "ensemble.json", (json.dumps(summary, indent=1) + "\n").encode())
    return summary

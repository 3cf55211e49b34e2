"""Ensembles trained side by side (`train.ensemble`, members.py): each member's config and share of
the cores, the run directory that decodes as one model, and signals that reach every member."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import one_line_error, tmt, wait_for, write_config, write_corpus

from transformer_mt.checkpoint import (
    CheckpointError,
    average_run,
    load_checkpoint,
    resolve_checkpoint,
    resolve_checkpoints,
    validation_score,
)
from transformer_mt.config import ConfigError, load_config
from transformer_mt.members import _READY, _Forwarded, core_shares, member_config
from transformer_mt.serve import checkpoint_name

pytestmark = pytest.mark.usefixtures("one_thread")


def test_members_differ_from_the_config_in_seed_threads_and_directory(copy_config):
    cfg = copy_config(ensemble=3, seed=5)
    members = [member_config(cfg, i, threads=2) for i in (1, 2, 3)]
    # member 1 is the model the config alone would train; the others count the seed up
    assert [m.train.seed for m in members] == [5, 6, 7]
    assert all(m.train.ensemble == 1 and m.train.threads == 2 for m in members)
    run = Path(cfg.output_dir)
    assert [Path(m.output_dir) for m in members] == [run / "members" / str(i) for i in (1, 2, 3)]

    def rest(c):
        d = c.to_dict()
        d.pop("output_dir")
        for key in ("seed", "threads", "ensemble"):
            d["train"].pop(key)
        return d

    assert all(rest(m) == rest(cfg) for m in members)


@pytest.mark.parametrize(
    "cores, n, shares",
    [
        ({0, 1}, 2, [[0], [1]]),
        ({0, 1, 2, 3}, 2, [[0, 1], [2, 3]]),
        ({0, 1, 2, 3, 4}, 2, [[0, 1], [2, 3]]),  # the odd core left over
        ({3, 7}, 2, [[3], [7]]),  # the cores this process may use, not 0..n-1
        ({0}, 2, None),  # fewer cores than members: no pinning
    ],
)
def test_core_shares_are_equal_and_disjoint(monkeypatch, cores, n, shares):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores, raising=False)
    assert core_shares(n) == shares


def test_an_ensemble_below_one_is_refused(copy_config):
    with pytest.raises(ConfigError, match=r"train\.ensemble.*>= 1"):
        copy_config(ensemble=0)


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_an_ensemble_run_directory_resolves_to_every_member(tmp_path):
    run = tmp_path / "runs" / "ens"
    first = _touch(run / "members" / "1" / "checkpoints" / "best.pt")
    second = _touch(run / "members" / "2" / "checkpoints" / "last.pt")  # no best.pt: its last
    tenth = _touch(run / "members" / "10" / "checkpoints" / "best.pt")  # in number order
    assert resolve_checkpoints(run) == [first, second, tenth]
    assert resolve_checkpoints(first) == [first]
    with pytest.raises(CheckpointError, match="ensemble of 3 models") as e:
        resolve_checkpoint(run)  # one model wanted (export, --init-from, ...)
    assert str(run / "members" / "1") in str(e.value)
    with pytest.raises(CheckpointError, match="ensemble of 3 models.*tmt average .*members/1"):
        average_run(run, last=2)

    # with no path: the newest run under runs/, an ensemble's members counted as its own
    older = _touch(tmp_path / "runs" / "single" / "checkpoints" / "last.pt")
    newer = _touch(run / "members" / "1" / "checkpoints" / "last.pt")
    os.utime(older, (1, 1))
    for last in (newer, second):
        os.utime(last, (2, 2))
    assert resolve_checkpoints(None, tmp_path / "runs") == [first, second, tenth]
    os.utime(older, (3, 3))
    assert resolve_checkpoints(None, tmp_path / "runs") == [older]


def test_the_server_names_an_ensemble_member_with_its_run():
    member = Path("/srv/runs/ens/members/2/checkpoints/best.pt")
    assert checkpoint_name(member) == "ens/members/2/best.pt"
    assert checkpoint_name(Path("/srv/runs/one/checkpoints/best.pt")) == "one/best.pt"


def test_init_from_and_a_resume_checkpoint_are_refused_for_an_ensemble(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(tmp_path / "e.yaml", corpus, tmp_path / "e", ensemble=2)
    one_line_error(capsys, ["train", str(cfg), "--init-from", "x"], "--init-from", "ensemble")
    one_line_error(capsys, ["train", str(cfg), "--resume", "x.pt"], "--resume x.pt", "own last.pt")
    assert not (tmp_path / "e").exists()


def test_an_ensemble_never_starts_over_a_run_and_resumes_only_what_exists(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(tmp_path / "e.yaml", corpus, tmp_path / "e", ensemble=2)
    held = _touch(tmp_path / "e" / "members" / "2" / "checkpoints" / "last.pt")
    one_line_error(capsys, ["train", str(cfg)], str(held.parent.parent), "--resume")
    held.unlink()
    one_line_error(capsys, ["train", str(cfg), "--resume"], "cannot resume", "no member")
    assert not (tmp_path / "e" / "config.yaml").exists()  # refused before writing anything
    # one model into an ensemble's directory, or an ensemble into one model's: refused
    one_line_error(capsys, ["train", str(cfg), "--set", "train.ensemble=1"], "ensemble of 1")
    _touch(tmp_path / "one" / "checkpoints" / "last.pt")
    other = write_config(tmp_path / "o.yaml", corpus, tmp_path / "one", ensemble=2)
    one_line_error(capsys, ["train", str(other)], "a run of one model")
    # fewer members than the directory holds: the extra ones would be decoded with the rest
    _touch(tmp_path / "e" / "members" / "3" / "train.log")
    one_line_error(capsys, ["train", str(cfg), "--resume"], "train.ensemble: 2", "holds 3 members")


def _member_weights(run: Path, i: int) -> dict[str, torch.Tensor]:
    path = run / "members" / str(i) / "checkpoints" / "last.pt"
    return torch.load(path, weights_only=True)["model"]


def test_an_ensemble_trains_its_members_and_decodes_as_one(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "runs" / "e"
    cfg = write_config(tmp_path / "e.yaml", corpus, run, max_steps=20, ensemble=2)
    proc = tmt("train", str(cfg))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert "trained an ensemble of 2: 20, 20 steps" in err
    members = [load_config(run / "members" / str(i) / "config.yaml") for i in (1, 2)]
    assert [m.train.seed for m in members] == [1, 2]
    assert all(m.train.ensemble == 1 for m in members)
    assert all(
        (run / "members" / str(i) / "spm.model").read_bytes() == (run / "spm.model").read_bytes()
        for i in (1, 2)
    )
    a, b = _member_weights(run, 1), _member_weights(run, 2)
    assert any(not torch.equal(a[k], b[k]) for k in a), "two seeds trained the same weights"
    summary = json.loads((run / "ensemble.json").read_text())
    assert [m["steps"] for m in summary["members"]] == [20, 20]
    for i, m in enumerate(summary["members"], 1):  # what each member's best.pt validated
        best_pt = load_checkpoint(run / "members" / str(i) / "checkpoints" / "best.pt")
        assert m["best_score"] == validation_score(best_pt["metrics"])
    assert 0 <= summary["valid_bleu"] <= 100

    # the run directory (also as the newest run under ./runs/) decodes as the ensemble of its
    # members' best checkpoints
    best = [str(run / "members" / str(i) / "checkpoints" / "best.pt") for i in (1, 2)]
    newest = tmt("evaluate", "--json", cwd=tmp_path)
    out, err = newest.communicate(timeout=300)
    assert newest.returncode == 0, err[-2000:]
    assert json.loads(out)["ensemble"] == [
        str(Path("runs/e") / b[len(str(run)) + 1 :]) for b in best
    ]
    whole = tmt("evaluate", "--checkpoint", str(run), "--json")
    out, err = whole.communicate(timeout=300)
    assert whole.returncode == 0, err[-2000:]
    result = json.loads(out)
    assert result["ensemble"] == best
    assert Path(result["hypotheses_path"]) == run / "ensemble.test.beam2.hyp"
    named = tmt("evaluate", "-c", best[0], "-c", best[1], "--json", "-o", str(tmp_path / "n.hyp"))
    out, err = named.communicate(timeout=300)
    assert named.returncode == 0, err[-2000:]
    assert (tmp_path / "n.hyp").read_text() == (run / "ensemble.test.beam2.hyp").read_text()


# Members that would train until their budget (3 minutes) unless stopped; every step checkpoint kept
ENDLESS = dict(max_steps=100000, max_minutes=3, valid_every=10, keep_last=100000, ensemble=2)


def _kill(proc) -> None:
    """Kill `tmt train` if it still runs: its members notice and stop too."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=60)


@contextlib.contextmanager
def _stopped_on_failure(proc):
    """Kill `tmt train` if it still runs when the block ends (the test failed midway)."""
    try:
        yield
    finally:
        _kill(proc)


def _training_past_step_10(tmp_path: Path) -> tuple[Path, Path, subprocess.Popen]:
    """An ENDLESS ensemble training in a subprocess, once both members have saved step 10: its
    config, run directory and process."""
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "e.yaml", corpus, run, **ENDLESS)
    proc = tmt("train", str(cfg))
    try:
        for i in (1, 2):
            wait_for(run / "members" / str(i) / "checkpoints" / "step_10.pt", proc)
    except BaseException:  # the caller never gets the process: stop it here
        _kill(proc)
        raise
    return cfg, run, proc


def _member_stopped(run: Path, i: int, timeout: float = 120) -> int:
    """Wait until member i's log says a signal stopped it; the step its last.pt holds."""
    log = run / "members" / str(i) / "train.log"
    deadline = time.time() + timeout
    while "stopped after step" not in (log.read_text() if log.exists() else ""):
        assert time.time() < deadline, f"member {i} did not stop: {log.read_text()[-2000:]}"
        time.sleep(0.05)
    return load_checkpoint(run / "members" / str(i) / "checkpoints" / "last.pt")["step"]


@pytest.mark.reliability
def test_sigterm_reaches_every_member_and_resume_continues_each(tmp_path):
    cfg, run, proc = _training_past_step_10(tmp_path)
    with _stopped_on_failure(proc):
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "--resume" in err and "Traceback" not in err
    stopped = [_member_stopped(run, i) for i in (1, 2)]
    assert all(s >= 10 for s in stopped)

    until = max(stopped) + 5
    resumed = tmt("train", str(cfg), "--resume", "--set", f"train.max_steps={until}")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    for i, step in zip((1, 2), stopped):
        log = (run / "members" / str(i) / "train.log").read_text()
        assert (
            f"resumed from {run / 'members' / str(i) / 'checkpoints' / 'last.pt'}: step {step},"
            in log
        )
        assert (
            load_checkpoint(run / "members" / str(i) / "checkpoints" / "last.pt")["step"] == until
        )


@pytest.mark.reliability
def test_members_stop_and_save_when_the_parent_is_killed(tmp_path):
    _, run, proc = _training_past_step_10(tmp_path)
    with _stopped_on_failure(proc):
        os.kill(proc.pid, signal.SIGKILL)  # no handler runs: the members notice on their own
        proc.wait(timeout=60)
        assert all(_member_stopped(run, i) >= 10 for i in (1, 2))


def test_a_signal_for_a_booting_member_waits_at_its_gate(monkeypatch):
    """A member killed before its handlers are in place would stop without its log or last.pt: the
    parent leaves the signal at its gate instead, and signals only members that took theirs."""
    import multiprocessing
    from types import SimpleNamespace

    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: sent.append((pid, signum)))
    gates = multiprocessing.get_context("spawn").Array("i", 3)
    gates[1] = _READY
    procs = [SimpleNamespace(pid=pid, exitcode=None) for pid in (101, 102, None)]
    _Forwarded(procs, gates).forward(signal.SIGTERM)
    assert sent == [(102, signal.SIGTERM)]
    assert list(gates) == [signal.SIGTERM, _READY, signal.SIGTERM]


@pytest.mark.reliability
def test_a_failing_member_stops_the_others_and_names_its_log(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(tmp_path / "f.yaml", corpus, tmp_path / "f", **ENDLESS)
    run = tmp_path / "f"
    (run / "members" / "2" / "train.log").mkdir(parents=True)  # member 2 cannot open its log
    proc = tmt("train", str(cfg))
    with _stopped_on_failure(proc):
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-2000:]
    assert "ensemble member 2 failed" in err
    log = (run / "members" / "1" / "train.log").read_text()
    assert "SIGTERM" in log and "max_minutes" not in log  # stopped by the parent, not its budget

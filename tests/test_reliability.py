"""Nothing lost, nothing let in: resume, interrupts, atomic and safe checkpoints, bad input (issue
5)."""

from __future__ import annotations

import os
import pickle
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import WORDS, one_line_error, tmt, wait_for, write_config, write_corpus

from transformer_mt.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from transformer_mt.cli import main

# One torch thread (conftest.py): 100,000 sentences decoded on a small, busy machine.
pytestmark = [pytest.mark.reliability, pytest.mark.usefixtures("one_thread")]


def scalars(run: Path, tag: str = "train/loss") -> dict[int, float]:
    """Scalars of the newest TensorBoard events file of a run."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    newest = max((run / "tb").glob("events.*"), key=lambda p: p.stat().st_mtime)
    out = {}
    for event in EventFileLoader(str(newest)).Load():
        for v in event.summary.value:
            if v.tag == tag:
                out[event.step] = v.simple_value
    return out


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


# --------------------------------------------------------------------------- exact resume


def test_sigkill_then_resume_gives_bit_identical_weights(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    cfg_a = write_config(tmp_path / "a.yaml", corpus, tmp_path / "a")
    cfg_b = write_config(tmp_path / "b.yaml", corpus, tmp_path / "b")
    straight = tmt("train", str(cfg_a))
    assert straight.wait(timeout=300) == 0, straight.communicate()[1][-2000:]

    killed = tmt("train", str(cfg_b))
    wait_for(tmp_path / "b" / "checkpoints" / "step_20.pt", killed)
    time.sleep(random.Random(1).uniform(0.05, 0.3))  # somewhere in the middle of later steps
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    resumed_from = load_checkpoint(tmp_path / "b" / "checkpoints" / "last.pt")["step"]
    assert 20 <= resumed_from < 60

    resumed = tmt("train", str(cfg_b), "--resume")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert "resumed from" in err and f"step {resumed_from}" in err

    a, b = (
        weights(tmp_path / "a" / "checkpoints" / "last.pt"),
        weights(tmp_path / "b" / "checkpoints" / "last.pt"),
    )
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), (
        "resumed weights differ from the uninterrupted run"
    )
    after_a = {s: v for s, v in scalars(tmp_path / "a").items() if s > resumed_from}
    after_b = scalars(tmp_path / "b")
    assert after_a and after_a == {s: v for s, v in after_b.items() if s > resumed_from}


def test_sigint_finishes_the_step_saves_last_and_exits_nonzero(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(
        tmp_path / "c.yaml", corpus, tmp_path / "c", max_steps=100000, valid_every=10
    )
    proc = tmt("train", str(cfg))
    wait_for(tmp_path / "c" / "checkpoints" / "step_10.pt", proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "SIGINT" in err and "--resume" in err and "Traceback" not in err
    assert load_checkpoint(tmp_path / "c" / "checkpoints" / "last.pt")["step"] >= 10


def test_second_sigint_stops_at_once(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(tmp_path / "d.yaml", corpus, tmp_path / "d", max_steps=100000)
    proc = tmt("train", str(cfg))
    wait_for(tmp_path / "d" / "checkpoints" / "step_10.pt", proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err


def test_training_into_an_existing_run_without_resume_is_refused(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(tmp_path / "e.yaml", corpus, tmp_path / "e", max_steps=10)
    assert main(["-q", "train", str(cfg)]) == 0
    assert main(["-q", "train", str(cfg)]) == 2
    assert main(["-q", "train", str(cfg), "--resume", "--set", "train.max_steps=20"]) == 0
    assert load_checkpoint(tmp_path / "e" / "checkpoints" / "last.pt")["step"] == 20


def test_resume_with_another_model_config_says_so(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(tmp_path / "f.yaml", corpus, tmp_path / "f", max_steps=10)
    assert main(["-q", "train", str(cfg)]) == 0
    capsys.readouterr()
    assert main(["-q", "train", str(cfg), "--resume", "--set", "model.d_ff=128"]) == 2
    assert "model.d_ff" in capsys.readouterr().err


def test_resume_that_changes_which_weights_decay_names_the_key(tmp_path, capsys):
    """Sparing the 1-D weights from decay adds an Adam parameter group, so a resume that flips
    train.decay_norms_and_biases cannot load the saved optimizer: one line naming the key, exit
    2."""
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(tmp_path / "w.yaml", corpus, tmp_path / "w", max_steps=10)
    assert main(["-q", "train", str(cfg), "--set", "train.weight_decay=0.1"]) == 0
    capsys.readouterr()
    flipped = ["--set", "train.weight_decay=0.1", "--set", "train.decay_norms_and_biases=false"]
    assert main(["-q", "train", str(cfg), "--resume", *flipped]) == 2
    assert "train.decay_norms_and_biases" in capsys.readouterr().err


def test_resume_from_an_averaged_checkpoint_names_the_file_that_resumes(tmp_path, capsys):
    """Issue 22, item 8: best.pt (when the average won) and averaged.pt hold weights only: --resume
    on them was a KeyError traceback; now one line naming checkpoints/last.pt, exit 2."""
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(
        tmp_path / "v.yaml", corpus, tmp_path / "v", max_steps=4, valid_every=2, average_last=2
    )
    assert main(["-q", "train", str(cfg)]) == 0
    ckpt_dir = tmp_path / "v" / "checkpoints"
    # as when the average validates best
    shutil.copy(ckpt_dir / "averaged.pt", ckpt_dir / "best.pt")
    capsys.readouterr()
    for name in ("averaged.pt", "best.pt"):
        one_line_error(
            capsys,
            ["-q", "train", str(cfg), "--resume", str(ckpt_dir / name)],
            name,
            "weights only",
            str(ckpt_dir.resolve() / "last.pt"),
        )


# max_epochs validating at every step: the last save then comes from inside the loop, before the
# stream has moved the epoch counter past the last epoch.
@pytest.mark.parametrize(
    "limit",
    [
        {"max_steps": 4, "valid_every": 2},
        {"max_epochs": 1, "valid_every": 1, "valid_bleu": "false"},
    ],
    ids=["max_steps", "max_epochs"],
)
def test_resume_of_a_finished_run_trains_nothing_and_rewrites_nothing(tmp_path, limit):
    """Issue 22, item 8: a resume at max_steps trained update max_steps + 1, rewrote last.pt and
    averaged again; one after the last epoch validated and wrote its checkpoints again (the epoch
    counter moves on lazily)."""
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(
        tmp_path / "f.yaml", corpus, tmp_path / "f", average_last=2, save_every=1, **limit
    )
    assert main(["-q", "train", str(cfg)]) == 0
    run = tmp_path / "f"

    def files():
        return {
            p.relative_to(run): (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*.pt")
        }

    before, events = files(), sorted((run / "tb").glob("events.*"))
    assert main(["-q", "train", str(cfg), "--resume"]) == 0
    assert files() == before
    assert sorted((run / "tb").glob("events.*")) == events
    if "max_steps" in limit:
        assert load_checkpoint(run / "checkpoints" / "last.pt")["step"] == 4


# --------------------------------------------------------------------------- checkpoints


def test_failed_write_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"model": {"w": torch.ones(3)}, "config": {}, "step": 1})

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    import transformer_mt.fileio as fileio

    monkeypatch.setattr(fileio.os, "fsync", disk_full)
    with pytest.raises(CheckpointError, match="No space left"):
        save_checkpoint(path, {"model": {"w": torch.zeros(3)}, "config": {}, "step": 2})
    monkeypatch.undo()
    ckpt = load_checkpoint(path)
    assert ckpt["step"] == 1 and torch.equal(ckpt["model"]["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left behind


class _Evil:
    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))  # unpickling would create this file


def test_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path, capsys):
    target = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        pickle.dump({"model": _Evil(str(target)), "config": {}, "step": 0}, f)
    with pytest.raises(CheckpointError, match="weights_only"):
        load_checkpoint(evil)
    assert main(["translate", "--checkpoint", str(evil), "--input", str(evil)]) == 2
    assert not target.exists()
    assert "not a loadable" in capsys.readouterr().err


def test_checkpoint_with_another_tokenizer_says_so(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(tmp_path / "g.yaml", corpus, tmp_path / "g", max_steps=4, valid_every=2)
    assert main(["-q", "train", str(cfg)]) == 0
    other = write_corpus(tmp_path / "other", seed=5)  # other sentences: another SentencePiece model
    cfg2 = write_config(tmp_path / "h.yaml", other, tmp_path / "h", max_steps=2, valid_every=2)
    assert main(["-q", "train", str(cfg2)]) == 0
    (tmp_path / "g" / "spm.model").write_bytes((tmp_path / "h" / "spm.model").read_bytes())
    capsys.readouterr()
    assert (
        main(["translate", "--checkpoint", str(tmp_path / "g"), "--input", str(corpus / "test.en")])
        == 2
    )
    assert "tokenizer" in capsys.readouterr().err


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "yaml_text, needles",
    [
        ("model:\n  d_model: 64\n  heads: 4: 5\n", ["bad.yaml:3", "invalid YAML"]),
        ("model:\n  d_modle: 64\n", ["bad.yaml:2", "model.d_modle", "did you mean d_model"]),
        ("train:\n  max_steps: many\n", ["bad.yaml:2", "train.max_steps", "integer"]),
        ("model:\n  dropout: 1.5\n", ["bad.yaml:2", "model.dropout", "[0, 1)"]),
        ("model:\n  d_model: 100\n  heads: 8\n", ["model.d_model", "divisible by model.heads"]),
        ("decode:\n  beam: 0\n", ["bad.yaml:2", "decode.beam", ">= 1"]),
    ],
)
def test_config_errors(tmp_path, capsys, yaml_text, needles):
    (tmp_path / "bad.yaml").write_text(yaml_text)
    one_line_error(capsys, ["train", str(tmp_path / "bad.yaml")], *needles)


def test_corpus_errors(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(tmp_path / "x.yaml", corpus, tmp_path / "x", max_steps=2)
    (corpus / "train.de").rename(corpus / "moved.de")
    one_line_error(capsys, ["train", str(cfg)], "corpus file not found", "train.de")
    (corpus / "moved.de").rename(corpus / "train.de")
    (corpus / "train.de").write_text("only one line\n")
    one_line_error(capsys, ["train", str(cfg)], "train.en", "300 lines", "train.de", "has 1")
    (corpus / "train.en").write_text("")
    (corpus / "train.de").write_text("")
    one_line_error(capsys, ["train", str(cfg)], "empty")
    (corpus / "train.en").write_bytes(b"good line\nbad \xff line\n")
    (corpus / "train.de").write_bytes(b"gut\nschlecht\n")
    one_line_error(capsys, ["train", str(cfg)], f"{corpus / 'train.en'}:2", "invalid UTF-8")


def test_invalid_utf8_can_be_replaced_and_counted(tmp_path, caplog):
    from transformer_mt.data import read_lines

    path = tmp_path / "x.en"
    path.write_bytes(b"ok\nbad \xff\nalso \xfe bad\nfine \xef\xbf\xbd already\n")
    with caplog.at_level("WARNING", logger="transformer_mt"):
        lines = read_lines(path, invalid_utf8="replace")
    assert lines == ["ok", "bad \ufffd", "also \ufffd bad", "fine \ufffd already"]
    assert "2 line(s) with invalid UTF-8 (first: line 2)" in caplog.text


def test_checkpoint_path_errors(tmp_path, capsys):
    one_line_error(
        capsys, ["evaluate", "--checkpoint", str(tmp_path / "nope.pt")], "not found", "nope.pt"
    )
    (tmp_path / "notes.pt").write_text("just text\n")
    one_line_error(
        capsys,
        ["evaluate", "--checkpoint", str(tmp_path / "notes.pt")],
        "notes.pt",
        "not a loadable",
    )


def test_overlong_translate_line_is_truncated_with_a_warning_and_stays_aligned(
    tiny_run, tmp_path, capsys
):
    src = tmp_path / "in.txt"
    src.write_text("alpha beta\n" + " ".join(["gamma"] * 500) + "\n\ndelta\n")
    out = tmp_path / "out.txt"
    assert (
        main(
            [
                "translate",
                "-c",
                str(tiny_run.dir),
                "-i",
                str(src),
                "-o",
                str(out),
                "--beam",
                "1",
            ]
        )
        == 0
    )
    assert "truncated" in capsys.readouterr().err
    lines = out.read_text().split("\n")
    assert len(lines) == 5 and lines[2] == "" and lines[4] == ""


def test_translate_streams_a_long_input_in_bounded_chunks(tiny_run):
    """Ten chunks of 2,000 lines: what holds for ten holds for the 100,000 lines this streamed
    before (27 s of make test on an AVX2-only EPYC), as each chunk is read only when the last is
    out."""
    from transformer_mt.checkpoint import load_for_inference, resolve_checkpoint
    from transformer_mt.inference import Translator

    model, tok, cfg, _ = load_for_inference(resolve_checkpoint(tiny_run.dir))
    translator = Translator.for_model(model, tok, cfg.decode)
    consumed = 0
    most_ahead = 0

    def lines():
        nonlocal consumed
        for i in range(20_000):
            consumed += 1
            yield WORDS[i % len(WORDS)] + "\n"

    produced = 0
    # A budget of one token and EOS: this test is about memory, and a model that copies its input
    # (the tiny one) would otherwise spend most of it decoding the words it does not know.
    for _ in translator.translate_stream(lines(), beam=1, chunk=2000, max_len=(0, 2)):
        produced += 1
        most_ahead = max(most_ahead, consumed - produced)
    assert produced == consumed == 20_000
    assert most_ahead <= 2000  # never more than one chunk held in memory


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = write_config(
        tmp_path / "n.yaml", corpus, tmp_path / "n", max_steps=4, valid_every=2, log_every=1
    )
    assert main(["-q", "train", str(cfg)]) == 0
    # An absurd learning rate overflows the weights within a few updates.
    one_line_error(
        capsys,
        [
            "-q",
            "train",
            str(cfg),
            "--resume",
            "--set",
            "train.lr_factor=1e39",
            "--set",
            "train.max_steps=200",
        ],
        "loss became",
        "between steps",
        "last.pt",
    )
    last = load_checkpoint(tmp_path / "n" / "checkpoints" / "last.pt")
    assert last["step"] >= 4
    assert all(torch.isfinite(v).all() for v in last["model"].values() if v.is_floating_point())

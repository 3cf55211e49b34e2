"""`tmt train --init-from`: fine-tuning a trained run on new data (issue 24, part 2).

The parent is the shared tiny run: a copy task over the tiny corpus's words. The new domain is a
pattern it never saw: each word becomes the next one in WORDS (alpha -> beta, ..., tango -> alpha),
so copying scores ~0 BLEU on it. A few hundred fine-tuning updates on that pattern must raise BLEU
on held-out sentences of it by FINE_TUNE_MARGIN, set before the test was first run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sacrebleu
import yaml
from conftest import WORDS, random_sentences

from transformer_mt import load
from transformer_mt.checkpoint import load_checkpoint
from transformer_mt.cli import main
from transformer_mt.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")

# BLEU points the fine-tuned run must gain over its parent on the new pattern's test sentences.
FINE_TUNE_MARGIN = 40.0
FINE_TUNE_STEPS = 250  # not the parent's 300: a continued schedule would show
SHIFT = {w: WORDS[(i + 1) % len(WORDS)] for i, w in enumerate(WORDS)}


def shifted(line: str) -> str:
    return " ".join(SHIFT[w] for w in line.split())


def write_shift_corpus(folder: Path) -> Path:
    """The new domain, in the tiny corpus's layout: `{train,valid,test}.{en,de}`; seeds other than
    the parent's corpus's (0 to 2)."""
    folder.mkdir()
    for seed, (split, n) in enumerate((("train", 400), ("valid", 12), ("test", 40)), start=10):
        src = random_sentences(n, seed)
        (folder / f"{split}.en").write_text("".join(s + "\n" for s in src), encoding="utf-8")
        (folder / f"{split}.de").write_text(
            "".join(shifted(s) + "\n" for s in src), encoding="utf-8"
        )
    return folder


def fine_tune_config(parent_config: Path, corpus: Path, out: Path, **model) -> Path:
    """The parent's YAML with the new corpus and output_dir (and model keys changed, if given),
    written beside the new corpus."""
    raw = yaml.safe_load(parent_config.read_text(encoding="utf-8"))
    raw["data"].update({split: str(corpus / split) for split in ("train", "valid", "test")})
    raw["model"].update(model)
    raw["output_dir"] = str(out)
    config = corpus.parent / "ft.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return config


def test_bleu(run: Path, corpus: Path) -> float:
    src = (corpus / "test.en").read_text(encoding="utf-8").splitlines()
    refs = (corpus / "test.de").read_text(encoding="utf-8").splitlines()
    hyps = load(run, device="cpu").translate_text(src, beam=1)
    return sacrebleu.corpus_bleu(hyps, [refs]).score


test_bleu.__test__ = False  # a helper, not a test


def test_fine_tuning_learns_a_new_pattern_with_the_parents_vocabulary(tiny_run, tmp_path, capsys):
    corpus = write_shift_corpus(tmp_path / "shift")
    out = tmp_path / "ft"
    config = fine_tune_config(tiny_run.config, corpus, out)
    sets = ["--set", f"train.max_steps={FINE_TUNE_STEPS}", "--set", "train.valid_every=150"]
    assert main(["train", str(config), "--init-from", str(tiny_run.dir), *sets]) == 0
    err = capsys.readouterr().err
    assert "<unk> pieces in the training corpus" in err and "0.00% of source" in err

    # the vocabulary is the parent's, byte for byte; the run says where it came from
    assert (out / "spm.model").read_bytes() == (tiny_run.dir / "spm.model").read_bytes()
    parent_ckpt = load_checkpoint(tiny_run.dir / "checkpoints" / "best.pt")
    record = json.loads((out / "parent.json").read_text(encoding="utf-8"))
    assert record == {
        "path": str((tiny_run.dir / "checkpoints" / "best.pt").resolve()),
        "step": parent_ckpt["step"],
        "tokenizer": parent_ckpt["tokenizer"],
    }
    last = load_checkpoint(out / "checkpoints" / "last.pt")
    assert last["parent"] == record and last["tokenizer"] == parent_ckpt["tokenizer"]
    # a new run: its own step count, a fresh schedule (warm-up from step 0)
    assert last["step"] == FINE_TUNE_STEPS and last["scheduler"]["last_epoch"] == FINE_TUNE_STEPS
    assert {int(s["step"]) for s in last["optimizer"]["state"].values()} == {FINE_TUNE_STEPS}
    assert "parent.json" in (out / "config.yaml").read_text(encoding="utf-8").splitlines()[0]
    assert load_config(out / "config.yaml").model == load_config(tiny_run.config).model

    # resumed later, it is still the parent's child
    more = ["--set", f"train.max_steps={FINE_TUNE_STEPS + 10}", "--set", "train.valid_bleu=false"]
    assert main(["-q", "train", str(config), "--resume", *more]) == 0
    resumed = load_checkpoint(out / "checkpoints" / "last.pt")
    assert resumed["step"] == FINE_TUNE_STEPS + 10 and resumed["parent"] == record
    assert "parent.json" in (out / "config.yaml").read_text(encoding="utf-8").splitlines()[0]

    before, after = test_bleu(tiny_run.dir, corpus), test_bleu(out, corpus)
    print(f"BLEU on the new pattern: parent {before:.1f}, fine-tuned {after:.1f}")
    assert after >= before + FINE_TUNE_MARGIN, (before, after)


def test_a_different_model_section_is_refused_naming_the_keys(tiny_run, tmp_path, capsys):
    corpus = write_shift_corpus(tmp_path / "shift")
    config = fine_tune_config(tiny_run.config, corpus, tmp_path / "ft", d_ff=128, heads=4)
    assert main(["-q", "train", str(config), "--init-from", str(tiny_run.dir)]) == 2
    err = capsys.readouterr().err
    assert "model.d_ff: checkpoint 64, config 128" in err and "model.heads" in err
    assert not (tmp_path / "ft").exists()  # refused before anything was written


def test_starts_from_the_parents_weights_and_dropout_may_change(tiny_run, tmp_path):
    corpus = write_shift_corpus(tmp_path / "shift")
    config = fine_tune_config(tiny_run.config, corpus, tmp_path / "ft", dropout=0.3)
    sets = ["--set", "train.max_steps=2", "--set", "train.valid_bleu=false"]
    parent = tiny_run.dir / "checkpoints" / "last.pt"
    assert main(["-q", "train", str(config), "--init-from", str(parent), *sets]) == 0
    # two updates early in the warm-up (lr < 1e-3) move no weight far from the parent's; a fresh
    # initialisation would be O(0.1) away
    mine = load_checkpoint(tmp_path / "ft" / "checkpoints" / "last.pt")["model"]
    theirs = load_checkpoint(parent)["model"]
    assert mine.keys() == theirs.keys()
    assert max((mine[k] - theirs[k]).abs().max().item() for k in mine) < 0.01
    assert load_config(tmp_path / "ft" / "config.yaml").model.dropout == 0.3


def test_init_from_with_resume_is_refused(tiny_run, tmp_path, capsys):
    config = fine_tune_config(tiny_run.config, write_shift_corpus(tmp_path / "s"), tmp_path / "ft")
    argv = ["-q", "train", str(config), "--init-from", str(tiny_run.dir), "--resume"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--init-from and --resume do not go together" in err


def test_init_from_into_a_directory_that_holds_a_run_is_refused(tiny_run, tmp_path, capsys):
    config = fine_tune_config(tiny_run.config, write_shift_corpus(tmp_path / "s"), tiny_run.dir)
    before = (tiny_run.dir / "checkpoints" / "last.pt").stat().st_mtime_ns
    assert main(["-q", "train", str(config), "--init-from", str(tiny_run.dir)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (tiny_run.dir / "checkpoints" / "last.pt").stat().st_mtime_ns == before

"""scripts/sweep.py: variants of one config trained side by side, read back from each run's tb/
events and last checkpoint."""

import json
import random
import textwrap
from pathlib import Path

import pytest

from scripts import sweep

pytestmark = pytest.mark.slow


def write_setup(root: Path) -> Path:
    """A tiny corpus (upper-casing colour words) and a config that trains on it in seconds,
    validating (with BLEU) every 2 updates."""
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    rng = random.Random(0)
    words = "red blue green black white gold silver pink".split()
    for split, n in (("train", 400), ("valid", 8)):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 8))) for _ in range(n)]
        (corpus / f"{split}.en").write_text("".join(x + "\n" for x in lines))
        (corpus / f"{split}.de").write_text("".join(x.upper() + "\n" for x in lines))
    cfg = root / "base.yaml"
    cfg.write_text(
        textwrap.dedent(f"""\
        data: {{src_lang: en, tgt_lang: de, train: {corpus}/train, valid: {corpus}/valid}}
        tokenizer: {{vocab_size: 80}}
        model: {{d_model: 32, heads: 2, encoder_layers: 1, decoder_layers: 1, d_ff: 64,
                 dropout: 0.0, max_positions: 64}}
        train: {{max_steps: 4, valid_every: 2, log_every: 2, max_tokens: 300, warmup: 4, threads: 1,
                 valid_bleu: true, device: cpu, precision: fp32, seed: 5}}
        output_dir: {root / "unused"}
        """)
    )
    return cfg


def test_each_variant_trains_with_its_overrides_and_its_validations_are_read_back(tmp_path):
    cfg = write_setup(tmp_path)
    out = tmp_path / "sweep"
    variants = ["--variant", "four", "--variant", "two", "train.max_steps=2"]
    argv = [str(cfg), "--out", str(out), "--parallel", "2", "--threads", "1"]
    assert sweep.main([*argv, "--set", "train.max_steps=4", *variants]) == 0
    results = json.loads((out / "results.json").read_text())
    # a validation every 2 of 4 updates, read from each run's event log
    assert [s for s, _, _ in results["four"]["curve"]] == [2, 4]
    assert [s for s, _, _ in results["two"]["curve"]] == [2]  # the variant's own override wins
    assert results["two"]["overrides"] == ["train.max_steps=2"]
    assert (results["four"]["steps"], results["two"]["steps"]) == (4, 2)  # from last.pt
    for r in results.values():
        assert r["last_bleu"] == r["curve"][-1][2] and 0 <= r["last_bleu"] <= 100
        assert r["best_bleu"] == max(b for _, _, b in r["curve"])
        assert r["last_loss"] > 0 and r["returncode"] == 0
    table = (out / "results.md").read_text()
    assert "| four |" in table and "| two |" in table
    assert table.splitlines()[1].startswith("| --- |")


def test_a_run_that_failed_before_writing_anything_reads_as_empty(tmp_path):
    """A variant whose `tmt train` stopped at once (a bad override) left no events and no
    checkpoint: it reads as no curve and no steps, and the sweep goes on to its table."""
    r = sweep.read_run(tmp_path / "broken")
    assert (r["curve"], r["last_bleu"], r["best_bleu"], r["steps"]) == ([], None, None, 0)
    assert "| broken | (none) | 0 | None |" in sweep.table(
        {"broken": {**r, "overrides": [], "minutes": 0.0}}
    )

"""scripts/sweep.py: variants of one config trained side by side, read back from each run's tb/
events and last checkpoint."""

import json

import pytest

from scripts import sweep

pytestmark = pytest.mark.slow


def test_each_variant_trains_with_its_overrides_and_its_validations_are_read_back(
    tiny_run, tmp_path
):
    """The shared tiny config, trained 4 updates from scratch, validating (with BLEU) every 2."""
    out = tmp_path / "sweep"
    variants = ["--variant", "four", "--variant", "two", "train.max_steps=2"]
    argv = [str(tiny_run.config), "--out", str(out), "--parallel", "2", "--threads", "1"]
    common = [
        "train.max_steps=4",
        "train.valid_every=2",
        "train.log_every=2",
        "train.valid_bleu=true",
    ]
    sets = [arg for kv in common for arg in ("--set", kv)]
    assert sweep.main([*argv, *sets, *variants]) == 0
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

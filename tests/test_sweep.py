"""scripts/sweep.py: variants of one config trained side by side, read back from `tmt train`'s own
log."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_distributed import write_setup

pytestmark = pytest.mark.slow
SWEEP = Path(__file__).resolve().parents[1] / "scripts" / "sweep.py"


def test_each_variant_trains_with_its_overrides_and_its_validations_are_read_back(tmp_path):
    cfg = write_setup(tmp_path, "base")
    cfg.write_text(
        cfg.read_text()
        .replace("valid_bleu: false", "valid_bleu: true")
        .replace("valid_every: 4", "valid_every: 2")
    )
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            str(SWEEP),
            str(cfg),
            "--out",
            str(out),
            "--parallel",
            "2",
            "--threads",
            "1",
            "--set",
            "train.max_steps=4",
            "--variant",
            "four",
            "--variant",
            "two",
            "train.max_steps=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    # a validation every 2 of 4 updates
    assert [s for s, _, _ in results["four"]["curve"]] == [2, 4]
    assert [s for s, _, _ in results["two"]["curve"]] == [2]  # the variant's own override wins
    assert results["two"]["overrides"] == ["train.max_steps=2"]
    assert results["two"]["stopped"] == "train.max_steps=2 reached"
    for r in results.values():
        assert 0 <= r["last_bleu"] <= 100 and r["last_loss"] > 0
        assert (out / ("four" if r["steps"] == 4 else "two") / "checkpoints" / "last.pt").exists()
    assert (
        "| four |" in (out / "results.md").read_text()
        and "| two |" in (out / "results.md").read_text()
    )

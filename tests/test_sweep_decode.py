"""scripts/sweep_decode.py: beam sizes and length penalties chosen on the validation set."""

import json

import pytest

from scripts import sweep_decode
from transformer_mt.evaluate import evaluate

pytestmark = pytest.mark.slow


def test_each_pair_scores_as_tmt_evaluate_does_and_the_table_ranks_by_the_mean(tiny_run, tmp_path):
    """Two checkpoints of the shared tiny run, each decoding its valid split with every (beam,
    alpha) pair: every score matches `tmt evaluate`'s with the same settings (its own load and
    decode), and the rows are ranked by the mean over the checkpoints."""
    ckpts = [str(tiny_run.dir / "checkpoints" / name) for name in ("best.pt", "last.pt")]
    out = tmp_path / "sweep"
    argv = [*ckpts, "--beam", "1", "3", "--alpha", "0", "1.5", "--out", str(out)]
    assert sweep_decode.main([*argv, "--device", "cpu"]) == 0
    results = json.loads((out / "results.json").read_text())
    valid = tiny_run.corpus / "valid"
    for ckpt in ckpts:
        scores = results["checkpoints"][ckpt]["scores"]
        assert sorted(scores) == ["1/0", "1/1.5", "3/0", "3/1.5"]
        for key, s in scores.items():
            beam, alpha = key.split("/")
            expected = evaluate(
                ckpt,
                src=f"{valid}.en",
                ref=f"{valid}.de",
                beam=int(beam),
                alpha=float(alpha),
                device="cpu",
                output=str(tmp_path / "hyp.txt"),
            )
            assert (s["bleu"], s["tokenized_bleu"]) == (
                expected["bleu"],
                expected["tokenized_bleu"],
            )
    rows = results["ranked"]
    assert len(rows) == 4
    means = [r["mean_bleu"] for r in rows]
    assert means == sorted(means, reverse=True)
    for r in rows:
        key = sweep_decode.pair_key(r["beam"], r["alpha"])
        each = [results["checkpoints"][c]["scores"][key]["bleu"] for c in ckpts]
        assert r["bleu"] == each and r["mean_bleu"] == pytest.approx(sum(each) / 2, abs=0.006)
    table = (out / "results.md").read_text()
    assert "nrefs:1" in table and f"`{ckpts[1]}`" in table
    assert table.count("\n| ") == 6  # the table's head, its rule and one row per pair


def test_src_without_ref_is_refused(capsys):
    with pytest.raises(SystemExit):
        sweep_decode.main(["x.pt", "--src", "valid.en", "--out", "o"])
    assert "give both --src and --ref" in capsys.readouterr().err

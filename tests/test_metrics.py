"""Evaluation a researcher can publish: sacreBLEU's paired tests, the literature's tokenized BLEU
beside sacreBLEU, and the BLEU tokenizer of the target language (issue 14)."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import pytest

from transformer_mt.metrics import compare, moses_tokenized, paper_bleu, score

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
WORDS = (
    "ein Hund Mann Frau läuft sitzt auf dem roten grünen Haus Baum im Park mit einer Katze".split()
)


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) + "." for _ in range(n)]


def test_paired_bootstrap_of_identical_systems_finds_no_difference():
    refs, hyps = sentences(200, 1), sentences(200, 2)
    result = compare([("a", hyps), ("b", list(hyps))], refs)
    assert result["method"] == "paired bootstrap resampling" and result["samples"] == 1000
    for metric in result["metrics"].values():
        base, other = metric["systems"]
        assert other["delta"] == 0 and other["p_value"] >= 0.5
        assert base["ci95"][0] <= base["score"] <= base["ci95"][1]


@pytest.mark.parametrize("method", ["bs", "ar"])
def test_a_system_right_on_30_percent_of_lines_is_significantly_better(method):
    refs, wrong = sentences(200, 3), sentences(200, 4)
    better = [r if i % 10 < 3 else w for i, (r, w) in enumerate(zip(refs, wrong))]
    result = compare(
        [("none right", wrong), ("30% right", better)], refs, method=method, samples=500
    )
    bleu = result["metrics"]["BLEU"]["systems"][1]
    assert bleu["delta"] > 0 and bleu["p_value"] < 0.05


def test_confidence_interval_brackets_the_score_and_shrinks_with_more_data():
    refs, hyps = sentences(400, 5), sentences(400, 6)
    hyps = [r if i % 2 else h for i, (r, h) in enumerate(zip(refs, hyps))]
    small = score(hyps[:50], refs[:50], names=("bleu",), confidence=300)["bleu_confidence"]
    large = score(hyps, refs, names=("bleu",), confidence=300)["bleu_confidence"]
    assert large["plus_minus"] < small["plus_minus"]
    assert abs(score(hyps, refs, names=("bleu",))["bleu"] - large["mean"]) < large["plus_minus"]


def test_several_references_count_a_match_with_either():
    refs_a, refs_b = sentences(50, 7), sentences(50, 8)
    hyps = [a if i % 2 else b for i, (a, b) in enumerate(zip(refs_a, refs_b))]
    two = score(hyps, [refs_a, refs_b], names=("bleu",))
    assert two["bleu"] == pytest.approx(100) and "nrefs:2" in two["bleu_signature"]
    assert score(hyps, refs_a, names=("bleu",))["bleu"] < 80


def test_tokenized_bleu_ignores_case_and_tokenizes_punctuation():
    refs = ["Ein Mann, der etwas anstarrt.", "Zwei Hunde spielen im Schnee."]
    cased = ["Ein Mann , der etwas anstarrt .", "Zwei Hunde spielen im Schnee."]
    assert (
        paper_bleu([h.lower() for h in cased], refs, "de")["tokenized_bleu"]
        == paper_bleu(cased, refs, "de")["tokenized_bleu"]
        == pytest.approx(100)
    )
    # 13a splits the punctuation too
    assert score(cased, refs, names=("bleu",))["bleu"] == pytest.approx(100)
    assert "not sacreBLEU" in paper_bleu(cased, refs, "de")["tokenized_bleu_description"]


@pytest.mark.skipif(not MULTI30K.is_dir(), reason="../shared/data/multi30k is not here")
@pytest.mark.parametrize("split", ["val", "test_2016_flickr"])
def test_our_tokenization_of_the_raw_references_is_the_official_one(split):
    with gzip.open(MULTI30K / f"{split}.de.gz", "rt", encoding="utf-8") as f:
        raw = [line.rstrip("\n") for line in f]
    with gzip.open(MULTI30K / "tok" / f"{split}.lc.norm.tok.de.gz", "rt", encoding="utf-8") as f:
        official = [line.rstrip("\n") for line in f]
    ours = moses_tokenized(raw, "de")
    agree = sum(a == b for a, b in zip(ours, official)) / len(official)
    assert len(ours) == len(official) and agree >= 0.995, f"{agree:.2%} of lines agree"
    assert paper_bleu(raw, [raw], "de")["tokenized_bleu"] == pytest.approx(100)


def test_the_bleu_tokenizer_follows_the_target_language():
    assert "tok:ja-mecab" in score(["猫"], ["猫"], names=("bleu",), lang="ja")["bleu_signature"]
    assert "tok:zh" in score(["猫"], ["猫"], names=("bleu",), lang="zh")["bleu_signature"]
    assert "tok:13a" in score(["cat"], ["cat"], names=("bleu",), lang="de")["bleu_signature"]
    assert (
        "tok:char"
        in score(["cat"], ["cat"], names=("bleu",), lang="ja", tokenize="char")["bleu_signature"]
    )
    assert "asian:yes" in score(["猫"], ["猫"], names=("ter",), lang="ja")["ter_signature"]


def test_japanese_is_really_tokenized_by_mecab():
    """One word differs: ja-mecab sees a long, mostly right sentence; 13a sees one wrong 'word'."""
    ref = ["私は昨日東京の大きな図書館で新しい本を三冊借りました。"]
    hyp = ["私は昨日東京の小さな図書館で新しい本を三冊借りました。"]
    mecab = score(hyp, ref, names=("bleu",), lang="ja")["bleu"]
    plain = score(hyp, ref, names=("bleu",), tokenize="13a")["bleu"]
    assert mecab > 50 and mecab > plain + 40

"""The `make demo` benchmark's own logic (issue 22, item 21): it reads BLEU and the samples from
what `make demo` prints, and a sample that drops a word is incomplete."""

from scripts import bench_demo
from scripts.benchlib import ROOT

# What `make demo` prints at its end (evaluate's BLEU line, then translate's samples through paste
# and sed), cut down; the second sample drops "das rote Auto", as the AVX2 run did.
OUTPUT = "\n".join(
    [
        "tmt: precision auto: nothing timed; bf16 skipped (no native bf16: ...); training in fp32",
        "trained 640 steps in 2.5 min; best validation 97.10 at step 640; run directory runs/demo",
        "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0 = 84.31 "
        "95.0/88.0/80.0/75.0 (BP = 0.970)",
        "The old man sees a small dog in the garden.",
        "  -> Der alte Mann sieht einen kleinen Hund im Garten.",
        "Today two young women buy the red car for their father.",
        "  -> Heute kaufen zwei junge Frauen für ihren Vater.",
        "",
    ]
)


def test_the_output_of_make_demo_is_read():
    parsed = bench_demo.parse_output(OUTPUT)
    assert parsed["bleu"] == 84.31 and parsed["signature"].endswith("version:2.6.0")
    assert parsed["updates"] == 640 and parsed["train_minutes"] == 2.5
    assert parsed["samples"] == [
        "Der alte Mann sieht einen kleinen Hund im Garten.",
        "Heute kaufen zwei junge Frauen für ihren Vater.",
    ]
    assert parsed["precision_line"].endswith("training in fp32")


def test_a_sample_that_drops_words_is_incomplete_and_fails_the_targets():
    references = (ROOT / "configs" / "demo_samples.de").read_text(encoding="utf-8").splitlines()
    assert (
        len(references)
        == len((ROOT / "configs" / "demo_samples.en").read_text(encoding="utf-8").splitlines())
        == 5
    )
    judged = bench_demo.judge_samples(bench_demo.parse_output(OUTPUT)["samples"], references)
    assert [s["complete"] for s in judged] == [True, False] and judged[0]["exact"]
    res = {"bleu": 84.31, "seconds": 334.0, "samples": judged}
    assert not any(bench_demo.verdict(res).values())  # BLEU, time and completeness all missed
    res = {
        "bleu": 96.0,
        "seconds": 280.0,
        "samples": bench_demo.judge_samples(references, references),
    }
    assert all(bench_demo.verdict(res).values())

"""The decoding benchmarks' own logic (issue 22): each contender's peak RSS is its own, and the
CTranslate2 agreement report counts and classifies what it is given. Nothing here imports torch at
the top: a fresh child process imports this module and measures its own memory."""

import multiprocessing

from scripts import ct2_agreement
from scripts.benchlib import peak_rss_mb

MB = 1 << 20


def touch_and_measure(allocate_mb: int) -> float:
    """Touch `allocate_mb` MiB, then report peak_rss_mb() (run in a fresh child process)."""
    x = bytearray(allocate_mb * MB)
    x[::4096] = b"1" * len(range(0, len(x), 4096))  # resident, not just reserved
    return peak_rss_mb()


def child_peak(allocate_mb: int) -> float:
    """peak_rss_mb() of a fresh Python process (spawned: fork + exec, as a contender's) that
    touched `allocate_mb` MiB."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(touch_and_measure, (allocate_mb,))


def test_each_child_reports_its_own_peak_not_its_parents():
    """This process holds 600 MiB while two children allocate 40 and 300 MiB. ru_maxrss (what the
    table used) reports the parent's 600+ for both children on Linux; each child's own peak is ~40 +
    the interpreter and ~300 + the interpreter."""
    ballast = bytearray(600 * MB)
    ballast[::4096] = b"1" * len(range(0, len(ballast), 4096))  # resident, not just reserved
    small, large = child_peak(40), child_peak(300)
    assert small < 200, small  # the interpreter is ~10-30 MiB; the parent's 600 MiB must not show
    assert 300 <= large < 500, large
    assert large - small > 200
    assert len(ballast) == 600 * MB  # kept alive until the children ran


def test_long_inputs_join_consecutive_sentences_in_pairs():
    assert ct2_agreement.long_inputs(["a b", " c ", "d", "e", "odd"]) == [
        "a b c",
        "d e",
    ]


def test_agreement_compares_piece_for_piece():
    same, differing = ct2_agreement.agreement(
        [["▁a", "b"], ["▁c"], []], [("▁a", "b"), ["▁c", "d"], []]
    )
    assert same == 2 and differing == [1]


def test_a_differing_line_is_a_tie_only_within_float_rounding():
    assert ct2_agreement.classify(-1.0, -1.0 + ct2_agreement.TIE / 2) == "tie"
    assert ct2_agreement.classify(-1.0, -1.5) == "ours better"
    assert ct2_agreement.classify(-1.5, -1.0) == "ctranslate2 better"


def test_settings_cover_the_runs_budget_and_the_short_one_on_both_inputs():
    settings = ct2_agreement.settings((1.2, 10))
    names = [(s["inputs"], tuple(s["max_len"])) for s in settings]
    assert names == [
        ("test", (1.2, 10)),
        ("long", (1.2, 10)),
        ("test", (0.0, 5)),
        ("long", (0.0, 5)),
    ]
    assert not any("|" in s["name"] for s in settings)  # a name is a cell of the report's table


def test_the_report_is_written_from_the_json_alone():
    setting = {
        "name": "test, --max-len 0 5",
        "sentences": 1000,
        "identical": 998,
        "share": 0.998,
        "differing": {"tie": 1, "ours better": 1, "ctranslate2 better": 0},
        "examples": [
            {
                "source": "A dog runs.",
                "ours": "Ein Hund",
                "ctranslate2": "Ein Hund läuft",
                "ours_score": -1.5,
                "ctranslate2_score": -1.6,
                "kind": "ours better",
            }
        ],
    }
    res = {
        "date": "2026-11-23 14:00",
        "cpu": "Some CPU",
        "checkpoint": "runs/x/checkpoints/best.pt",
        "source": "test_2016_flickr.en.gz",
        "beam": 5,
        "alpha": 1.0,
        "settings": [setting],
    }
    text = "\n\n".join(ct2_agreement.report(res))
    assert "| test, --max-len 0 5 | 1,000 | 998 | 99.80% | 1 | 1 | 0 |" in text
    assert "`Ein Hund läuft`" in text and "beam 5, α 1" in text
    assert peak_rss_mb() > 0


def test_the_decoding_table_hides_a_peak_that_is_not_the_contenders_own():
    """Issue 22, item 19: rows measured before each child reported its own VmHWM carry the bench's
    peak for all."""
    from scripts import bench  # imports torch: not at the top (see the module's docstring)

    row = {
        "engine": "torch",
        "precision": "fp32",
        "sent_s": 60.0,
        "runs": [60.0],
        "peak_rss_mb": 10152,
    }
    old = "\n".join(bench.decoding_blocks({"decoding": {"ours": row}}))
    new = "\n".join(
        bench.decoding_blocks({"decoding": {"ours": {**row, "peak_rss_mb": 452, "rss_of": "self"}}})
    )
    assert "10152" not in old and "–*" in old and "Peak RSS not shown" in old
    assert "| 452 |" in new and "Peak RSS not shown" not in new

"""The inference layer (inference.py) over our engine: per-call options, empty lines, truncation and
batching, each checked against search.py called directly on the same ids, which the layer must
only feed (the engines' agreement with each other is tests/test_export.py's)."""

import dataclasses
import logging

import pytest
import torch

from transformer_mt.data import pad_sources
from transformer_mt.decoding import DecodeOptions
from transformer_mt.inference import Translator, load_translator
from transformer_mt.search import Sampling, forced_logprobs, search
from transformer_mt.vocab import BOS, EOS

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS = [
    {"beam": 1},
    {"beam": 3},
    {"beam": 3, "nbest": 2},
    {"beam": 3, "alpha": 1.5},
    {"beam": 2, "max_len": (0.5, 2)},
    {"beam": 1, "max_len": (0.0, 3)},
]


@pytest.fixture(scope="module")
def translator(tiny_run) -> Translator:
    return load_translator(tiny_run.dir, device="cpu")


def direct(translator: Translator, lines: list[str], options: DecodeOptions) -> list[list[str]]:
    """Each line's n-best texts from search.search on one batch of the lines' ids, in input order:
    what the layer must give, whatever batches it cuts."""
    engine = translator.engine
    ids = translator.tokenizer.encode_src(lines)
    found = search(
        engine.model,
        pad_sources(ids),
        beam=options.beam,
        alpha=options.alpha,
        max_len_a=options.max_len_a,
        max_len_b=options.max_len_b,
        nbest=options.nbest,
    )
    return [[translator.tokenizer.decode_tgt([h.tokens])[0] for h in hyps] for hyps in found]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_each_call_decodes_with_its_own_options_as_search_does(translator, sentences, options):
    lines = sentences(24, seed=5, length=(1, 9))
    got = [[t.text for t in hyps] for hyps in translator.translate(lines, **options)]
    want = direct(translator, lines, translator.defaults.replace(**options))
    same = sum(g == w for g, w in zip(got, want))
    assert same >= 0.9 * len(lines), list(zip(got, want))  # near-ties may fall either way
    assert all(len(g) == options.get("nbest", 1) for g in got)


def test_a_call_leaves_the_defaults_as_they_were(translator, sentences):
    lines = sentences(6, seed=8)
    before = [h[0].score for h in translator.translate(lines)]
    translator.translate(lines, beam=1, alpha=2.0, max_len=(0, 2))
    assert translator.defaults.beam == 2 and translator.defaults.max_len_b == 5  # the run's
    assert [h[0].score for h in translator.translate(lines)] == before


def test_many_small_batches_give_what_one_batch_gives(translator, sentences):
    lines = sentences(30, seed=9, length=(1, 8))
    one = translator.translate(lines, beam=2)
    small = Translator(
        translator.engine, dataclasses.replace(translator.defaults, max_src_tokens=20)
    )
    assert len(small._batches([len(x) for x in small.tokenizer.encode_src(lines)], 2, 20)) > 5
    many = small.translate(lines, beam=2)
    same = sum(a[0].text == b[0].text for a, b in zip(one, many))
    assert same >= 0.9 * len(lines)


def test_empty_lines_translate_to_nothing_without_the_engine(translator, monkeypatch):
    calls = []
    search_once = translator.engine.search
    monkeypatch.setattr(
        translator.engine,
        "search",
        lambda ids, *a, **k: calls.append(ids) or search_once(ids, *a, **k),
    )
    out = translator.translate(["", "alpha beta", "   "])
    assert [h[0].text for h in out][0] == "" and out[2][0].text == ""
    assert out[0][0].pieces == [] and out[0][0].logprob == 0.0
    assert calls == [[translator.tokenizer.encode_src(["alpha beta"])[0]]]


def test_a_source_longer_than_the_model_is_cut_once_with_a_warning(translator, caplog):
    limit = translator.max_positions - 1
    words = ("alpha beta gamma " * 200).split()
    long_line = " ".join(words)
    ids = translator.tokenizer.encode_src([long_line])[0]
    assert len(ids) > limit
    with caplog.at_level(logging.WARNING, logger="transformer_mt"):
        got = translator.translate([long_line], beam=1)
    warnings = [r for r in caplog.records if "truncated" in r.getMessage()]
    assert len(warnings) == 1 and f"longer than {limit} tokens" in warnings[0].getMessage()
    found = translator.translate_ids([ids[:limit]], translator.defaults.replace(beam=1))
    assert got[0][0].text == translator.tokenizer.decode_tgt([found[0][0].tokens])[0]


def test_a_seeded_sampling_call_repeats_and_draws_one_hypothesis(translator, sentences):
    lines = sentences(10, seed=3)
    sampling = Sampling(topk=0, temperature=1.5, seed=11)
    first = [h[0].text for h in translator.translate(lines, sampling=sampling)]
    again = [h[0].text for h in translator.translate(lines, sampling=sampling)]
    other = [h[0].text for h in translator.translate(lines, sampling=Sampling(topk=0, seed=12))]
    assert first == again
    assert all(len(h) == 1 for h in translator.translate(lines, sampling=sampling, nbest=1))
    assert len(other) == len(first)


def test_scores_are_the_forced_log_probabilities_of_the_targets(translator, sentences):
    sources, targets = sentences(8, seed=4), sentences(8, seed=6)
    scored = translator.score(sources, targets)
    tok = translator.tokenizer
    for s, t, got in zip(sources, targets, scored):
        src = pad_sources(tok.encode_src([s]))
        tgt = tok.encode_tgt([t])[0]
        tgt_in, tgt_out = torch.tensor([[BOS] + tgt]), torch.tensor([tgt + [EOS]])
        want = forced_logprobs(translator.engine.model, src, tgt_in, tgt_out)[0].tolist()
        assert got.token_logprobs == pytest.approx(want, abs=1e-4)
        assert got.logprob == pytest.approx(sum(want), abs=1e-3)
        assert got.tokens == tok.tgt.id_to_piece(tgt)


def test_nbest_over_the_beam_is_refused_naming_both(translator):
    from transformer_mt.config import ConfigError

    with pytest.raises(ConfigError, match="--nbest 3 is more than the beam \\(2\\)"):
        translator.translate(["alpha"], beam=2, nbest=3)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"alpha": -1.0}, "--alpha must be >= 0"),
        ({"max_len": (1.0, 0)}, "--max-len A B needs A >= 0 and B >= 1"),
        ({"max_len": (1.0, 2.5)}, "B must be a whole number"),
        ({"beam": 0}, "--beam must be >= 1"),
    ],
)
def test_out_of_range_options_are_refused_as_the_config_refuses_them(translator, options, message):
    from transformer_mt.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        translator.translate(["alpha"], **options)


def test_bad_translate_flags_fail_before_the_output_file_is_opened(tiny_run, tmp_path, capsys):
    from transformer_mt.cli import main

    out = tmp_path / "out.txt"
    argv = ["translate", "-c", str(tiny_run.dir), "--max-len", "1", "0", "-o", str(out)]
    assert main(argv) == 2
    assert "--max-len A B needs" in capsys.readouterr().err and not out.exists()

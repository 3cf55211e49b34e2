"""Search: beam 1 is greedy, a wide beam finds the exhaustive optimum, batching changes nothing."""

import itertools
import math

import pytest
import torch
from helpers import make_model, sequence_logprob, sources

from transformer_mt.search import beam_search, greedy_search, length_penalty, topk_rows
from transformer_mt.vocab import BOS, EOS, PAD, UNK


def best(found) -> list[list[int]]:
    """The best hypothesis's tokens for each sentence of a search's n-best lists."""
    return [hyps[0].tokens for hyps in found]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_one_equals_greedy(seed):
    model = make_model(40, seed)
    src = sources(5, 8, 40, seed)
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=5)
    beam = beam_search(model, src, beam=1, alpha=0.0, max_len_a=1.0, max_len_b=5)
    assert best(beam) == best(greedy)
    assert any(len(h) > 0 for h in best(greedy))


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize("seed", [0, 3])
def test_wide_beam_finds_the_exhaustive_optimum(alpha, seed):
    vocab = 7  # PAD, UNK, BOS, EOS and three real tokens
    model = make_model(vocab, seed, sharpen=1.0)
    src = torch.tensor([[4, 5, 6, EOS]])
    max_len = 4  # at most 3 tokens, then EOS (max_len_a = 0, max_len_b = 4)
    allowed = [UNK, 4, 5, 6]  # never PAD or BOS
    best, best_score = None, -math.inf
    with torch.no_grad():
        for n in range(max_len):
            for seq in itertools.product(allowed, repeat=n):
                score = sequence_logprob(model, src, list(seq)) / length_penalty(n + 1, alpha)
                if score > best_score:
                    best, best_score = list(seq), score
    # A beam wider than every step's candidate count (16 live x 5 tokens) prunes nothing.
    found = beam_search(model, src, beam=100, alpha=alpha, max_len_a=0.0, max_len_b=max_len)[0][0]
    assert found.tokens == best
    assert found.score == pytest.approx(best_score, abs=1e-5)


@pytest.mark.parametrize("vocab", [40, 1100])  # 1100: wide enough for topk_rows to search blocks
def test_batched_beam_search_equals_one_sentence_at_a_time(vocab):
    """Sentences finish at different steps and leave the batch; the others must not notice."""
    model = make_model(vocab, 5)
    src = sources(6, 9, vocab, 5)
    batched = best(beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=4))
    for b in range(src.size(0)):
        row = src[b : b + 1, : int((src[b] != PAD).sum())]
        assert (
            best(beam_search(model, row, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=4))[0]
            == batched[b]
        )
    assert len({tuple(h) for h in batched}) > 1


def test_outputs_respect_the_length_budget():
    model = make_model(40, 6)
    src = sources(4, 10, 40, 6)
    n_src = (src != PAD).sum(1)
    for search in (
        lambda: greedy_search(model, src, max_len_a=0.5, max_len_b=2),
        lambda: beam_search(model, src, beam=3, max_len_a=0.5, max_len_b=2),
    ):
        for hyp, n in zip(best(search()), n_src.tolist()):
            assert len(hyp) + 1 <= int(0.5 * n + 2)  # EOS counts toward the budget
            assert PAD not in hyp and BOS not in hyp and EOS not in hyp


def test_length_penalty_is_gnmt():
    assert length_penalty(1, 1.0) == pytest.approx(1.0)
    assert length_penalty(7, 0.6) == pytest.approx((12 / 6) ** 0.6)
    assert length_penalty(10, 0.0) == 1.0


# 1100, 300: a partial last block; 40: torch.topk
@pytest.mark.parametrize("V, k", [(8000, 8), (1100, 8), (300, 2), (40, 8)])
def test_topk_rows_equals_torch_topk(V, k):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(37, V, generator=g)  # continuous values: no ties, so the indices are unique too
    x[:, :3] = -math.inf  # masked tokens, as beam search has them
    x[5, -1] = 100.0  # a row whose best value sits in the partial last block
    values, cols = topk_rows(x, k)
    ref = x.topk(k, dim=1)
    assert torch.equal(values, ref.values) and torch.equal(cols, ref.indices)


# --------------------------------------------------------------------------- n-best, scores,
# ensembles, sampling


def forced(model, src_row: torch.Tensor, tokens: list[int]) -> list[float]:
    """Per-token log-probabilities of tokens + EOS by forced decoding (search.forced_logprobs)."""
    from transformer_mt.search import forced_logprobs

    tgt_in, tgt_out = torch.tensor([[BOS] + tokens]), torch.tensor([tokens + [EOS]])
    return forced_logprobs(model, src_row, tgt_in, tgt_out)[0].tolist()


def test_nbest_is_sorted_distinct_and_starts_with_the_one_best():
    model = make_model(40, 7)
    src = sources(4, 8, 40, 7)
    one = beam_search(model, src, beam=5, alpha=0.6, max_len_a=1.0, max_len_b=5)
    many = beam_search(model, src, beam=5, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=3)
    for single, hyps in zip(one, many):
        assert len(single) == 1 and len(hyps) == 3
        assert hyps[0].tokens == single[0].tokens
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 3
        for h in hyps:  # the ranking score is the sentence log-probability over the GNMT penalty
            assert h.score == pytest.approx(
                h.logprob / length_penalty(len(h.tokens) + 1, 0.6), rel=1e-5
            )


@pytest.mark.parametrize("how", ["greedy", "beam", "ensemble of one"])
def test_reported_logprobs_equal_forced_decoding(how):
    """What search reports for a hypothesis (built step by step through the KV cache) equals one
    teacher-forced pass over the same pair, token by token, within 1e-4 in fp32."""
    from transformer_mt.model import Ensemble

    model = make_model(40, 8)
    searched = Ensemble([model]) if how == "ensemble of one" else model
    src = sources(3, 7, 40, 8)
    beam = 1 if how == "greedy" else 4
    found = (
        greedy_search(searched, src, max_len_a=1.0, max_len_b=5)
        if beam == 1
        else beam_search(searched, src, beam=beam, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=2)
    )
    for b, hyps in enumerate(found):
        row = src[b : b + 1, : int((src[b] != PAD).sum())]
        for h in hyps:
            expected = forced(model, row, h.tokens)
            assert len(h.token_logprobs) == len(h.tokens) + 1
            assert h.token_logprobs == pytest.approx(expected, abs=1e-4)
            assert h.logprob == pytest.approx(sum(expected), abs=1e-4)


def test_an_ensemble_of_one_model_twice_decodes_like_the_model():
    from transformer_mt.model import Ensemble

    model = make_model(40, 9)
    src = sources(5, 8, 40, 9)
    single = beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5)
    twice = beam_search(
        Ensemble([model, model]), src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5
    )
    assert best(twice) == best(single)
    assert [h[0].logprob for h in twice] == pytest.approx([h[0].logprob for h in single], abs=1e-5)


def test_an_ensemble_averages_probabilities_not_log_probabilities():
    from transformer_mt.model import Ensemble

    a, b = make_model(40, 10), make_model(40, 11)
    src = sources(2, 6, 40, 10)
    tgt_in = torch.tensor([[BOS, 5, 6], [BOS, 7, 8]])
    mixed = Ensemble([a, b])(src, tgt_in).exp()
    expected = (a(src, tgt_in).softmax(-1) + b(src, tgt_in).softmax(-1)) / 2
    torch.testing.assert_close(mixed, expected, atol=1e-6, rtol=1e-5)


def test_sampling_is_deterministic_for_a_seed_and_greedy_at_temperature_zero():
    from transformer_mt.search import Sampling

    model = make_model(40, 12, sharpen=0.5)  # flat distributions: draws differ when seeds differ
    src = sources(6, 8, 40, 12)

    def draw(sampling: Sampling) -> list[list[int]]:
        return best(
            greedy_search(
                model,
                src,
                max_len_a=1.0,
                max_len_b=6,
                sampling=sampling,
                generator=sampling.generator(src.device),
            )
        )

    assert draw(Sampling(topk=0, seed=1)) == draw(Sampling(topk=0, seed=1))
    assert draw(Sampling(topk=0, seed=1)) != draw(Sampling(topk=0, seed=2))
    greedy = best(greedy_search(model, src, max_len_a=1.0, max_len_b=6))
    assert draw(Sampling(temperature=0.0, seed=3)) == greedy
    assert draw(Sampling(topk=1, seed=4)) == greedy  # one candidate left: the most likely
    assert draw(Sampling(topp=1e-6, seed=5)) == greedy  # the nucleus keeps at least the best token
    assert draw(Sampling(temperature=1e-4, seed=6)) == greedy  # temperature -> 0 tends to greedy

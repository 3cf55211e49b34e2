"""Search: beam 1 is greedy, a wide beam finds the exhaustive optimum, batching changes nothing."""

import itertools
import math

import pytest
import torch

from transformer_mt.config import ModelConfig
from transformer_mt.model import Transformer
from transformer_mt.search import beam_search, greedy_search, length_penalty, topk_rows
from transformer_mt.vocab import BOS, EOS, PAD, UNK


def make_model(vocab: int, seed: int, sharpen: float = 3.0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, heads=4, encoder_layers=1, decoder_layers=2, d_ff=64, dropout=0.0,
                      max_positions=64, tie_embeddings=False)
    model = Transformer(cfg, vocab, vocab, joint_vocab=True).eval()
    with torch.no_grad():  # peakier distributions than at initialisation, so that choices matter
        model.generator.weight.mul_(sharpen)
    return model


def sources(B: int, S: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (B, S), generator=g)
    src[:, -1] = EOS
    for b in range(1, B):
        src[b, S - 1 - b:] = PAD
        src[b, S - 1 - b] = EOS
    return src


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_one_equals_greedy(seed):
    model = make_model(40, seed)
    src = sources(5, 8, 40, seed)
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=5)
    beam = beam_search(model, src, beam=1, alpha=0.0, max_len_a=1.0, max_len_b=5)
    assert beam == greedy
    assert any(len(h) > 0 for h in greedy)


def sequence_logprob(model: Transformer, src: torch.Tensor, tokens: list[int]) -> float:
    """log P(tokens + EOS | src) by one teacher-forced forward pass (no cache involved)."""
    tgt_in = torch.tensor([[BOS] + tokens])
    tgt_out = torch.tensor(tokens + [EOS])
    logp = model(src, tgt_in).log_softmax(-1)[0]  # (T, V)
    return float(logp.gather(1, tgt_out[:, None]).sum())


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
    found = beam_search(model, src, beam=100, alpha=alpha, max_len_a=0.0, max_len_b=max_len)[0]
    assert found == best


@pytest.mark.parametrize("vocab", [40, 1100])  # 1100: wide enough for topk_rows to search blocks
def test_batched_beam_search_equals_one_sentence_at_a_time(vocab):
    """Sentences finish at different steps and leave the batch; the others must not notice."""
    model = make_model(vocab, 5)
    src = sources(6, 9, vocab, 5)
    batched = beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=4)
    for b in range(src.size(0)):
        row = src[b:b + 1, : int((src[b] != PAD).sum())]
        assert beam_search(model, row, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=4)[0] == batched[b]
    assert len({tuple(h) for h in batched}) > 1


def test_outputs_respect_the_length_budget():
    model = make_model(40, 6)
    src = sources(4, 10, 40, 6)
    n_src = (src != PAD).sum(1)
    for search in (lambda: greedy_search(model, src, max_len_a=0.5, max_len_b=2),
                   lambda: beam_search(model, src, beam=3, max_len_a=0.5, max_len_b=2)):
        for hyp, n in zip(search(), n_src.tolist()):
            assert len(hyp) + 1 <= int(0.5 * n + 2)  # EOS counts toward the budget
            assert PAD not in hyp and BOS not in hyp and EOS not in hyp


def test_length_penalty_is_gnmt():
    assert length_penalty(1, 1.0) == pytest.approx(1.0)
    assert length_penalty(7, 0.6) == pytest.approx((12 / 6) ** 0.6)
    assert length_penalty(10, 0.0) == 1.0


@pytest.mark.parametrize("V, k", [(8000, 8), (1100, 8), (300, 2), (40, 8)])  # 1100, 300: a partial last block; 40: torch.topk
def test_topk_rows_equals_torch_topk(V, k):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(37, V, generator=g)  # continuous values: no ties, so the indices are unique too
    x[:, :3] = -math.inf  # masked tokens, as beam search has them
    x[5, -1] = 100.0  # a row whose best value sits in the partial last block
    values, cols = topk_rows(x, k)
    ref = x.topk(k, dim=1)
    assert torch.equal(values, ref.values) and torch.equal(cols, ref.indices)

"""Subword sampling (data.subword_sampling): the n best segmentations, the draws each epoch, and
the batches they make."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from transformer_mt.config import (
    ConfigError,
    DataConfig,
    TokenizerConfig,
    TrainConfig,
    config_from_dict,
)
from transformer_mt.data import EpochBatches, TrainingData, collate, load_tokenized
from transformer_mt.errors import UserError
from transformer_mt.segmentations import NBest, SampledSegmentations, sampled_segmentations
from transformer_mt.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def unigram(sentences):
    """A unigram model small enough that most words have several segmentations."""
    lines = sentences(300, seed=5)
    return train_tokenizer(TokenizerConfig(vocab_size=60), lines, [s.upper() for s in lines])


def test_nbest_gives_the_ordinary_encoding_first_and_only_spellings_of_the_line(unigram, sentences):
    lines = [*sentences(20, seed=7), ""]
    found = unigram.nbest(lines, 8, "src")
    assert [c[0] for c in found] == unigram.encode_src(lines)
    log_probs = unigram.piece_log_probs("src")
    for line, cands in zip(lines, found):
        scores = [log_probs[ids].sum() for ids in cands]
        assert all(a >= b - 1e-3 for a, b in zip(scores, scores[1:]))  # best first
        assert {unigram.src.decode(ids) for ids in cands} == {line}
    assert sum(len(c) for c in found[:-1]) > 2 * 20  # the words have other segmentations


def test_a_bpe_model_has_no_nbest_to_sample(sentences):
    lines = sentences(300, seed=5)
    bpe = train_tokenizer(TokenizerConfig(type="bpe", vocab_size=60), lines, lines)
    with pytest.raises(UserError, match="unigram"):
        bpe.nbest(lines[:3], 4, "src")


LOG_PROBS = -0.1 * np.arange(10)  # piece i: log-probability -0.1 i


def test_build_weights_candidates_by_probability_to_the_alpha_and_drops_long_ones():
    per_line = [
        [[5, 6], [5, 7, 8], [9, 9, 9, 9]],  # log P -1.1, -2.0, and one longer than max_len
        [[1, 2, 3, 4, 5]],  # longer than max_len, but the best one always stays
    ]
    nb = NBest.build(per_line, LOG_PROBS, alpha=0.5, max_len=3)
    assert nb.first.tolist() == [0, 2, 3]
    expected = np.exp([-0.55, -1.0]) / np.exp([-0.55, -1.0]).sum()  # P^0.5, normalised
    assert nb.prob[:2] == pytest.approx(expected)
    assert nb.prob[2] == 1.0
    assert nb.gather(np.array([1, 2]))[0].tolist() == [5, 7, 8, 1, 2, 3, 4, 5]
    assert nb.gather(np.array([1, 2]))[1].tolist() == [0, 3, 8]
    assert nb.best_share() == pytest.approx((expected[0] + 1.0) / 2)
    halves = NBest.concat(
        [NBest.build(p, LOG_PROBS, 0.5, 3) for p in ([per_line[0]], [per_line[1]])]
    )
    assert all(np.array_equal(getattr(halves, k), getattr(nb, k)) for k in vars(nb))


def test_draws_follow_the_probabilities_and_stay_within_each_sentence():
    # sentences of 1, 3 and 5 candidates (one piece each: log P is the piece's)
    shapes = [[[0]], [[1], [3], [6]], [[2], [4], [5], [7], [9]]]
    nb = NBest.build(shapes * 5000, LOG_PROBS, alpha=4.0, max_len=10)
    chosen = nb.draw(np.random.default_rng(0))
    assert ((chosen >= nb.first[:-1]) & (chosen < nb.first[1:])).all()
    for k, cands in enumerate(shapes):
        p = np.exp(4.0 * LOG_PROBS[[c[0] for c in cands]])
        p /= p.sum()
        within = chosen[k::3] - nb.first[:-1][k::3]
        freq = np.bincount(within, minlength=len(cands)) / len(within)
        # within 5 standard errors of a binomial share: a wrong weighting is far outside
        assert (np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / len(within)) + 1e-12).all()


def test_an_epoch_is_a_pure_function_of_seed_and_epoch(unigram, sentences):
    lines = sentences(50, seed=3)
    # the toy model's best segmentation is far ahead: a small alpha draws the others too
    sides = [
        NBest.build(unigram.nbest(lines, 8, s), unigram.piece_log_probs(s), 0.05, 100)
        for s in ("src", "tgt")
    ]
    a, b = SampledSegmentations(*sides, seed=1), SampledSegmentations(*sides, seed=1)
    assert np.array_equal(a.corpus(4).src_ids, b.corpus(4).src_ids)
    assert not np.array_equal(a.corpus(4).src_ids, a.corpus(5).src_ids)
    epoch = a.corpus(4)
    assert [unigram.src.decode(epoch.src(i).tolist()) for i in range(50)] == lines


@dataclass
class Position:
    epoch: int = 1
    batch_in_epoch: int = 0


def sampled_data(unigram, tmp_path, sentences, **sampling):
    lines = sentences(120, seed=11)
    for lang in ("en", "de"):
        (tmp_path / f"train.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = config_from_dict(
        {"data": {"train": str(tmp_path / "train"), "subword_sampling": sampling}}
    )
    train = load_tokenized(cfg.data, "train", unigram, tmp_path / "cache")
    data = TrainingData(train, np.arange(len(train)))
    data.segmentations = sampled_segmentations(cfg, unigram)
    return data


def test_resuming_mid_epoch_streams_what_the_whole_run_streams(unigram, tmp_path, sentences):
    data = sampled_data(unigram, tmp_path, sentences, nbest=8, alpha=0.05)
    tc = TrainConfig(max_tokens=64, max_epochs=3)
    whole = [b.src.tolist() for b, _ in EpochBatches(data, tc).stream(Position())]
    n_first = len(EpochBatches(data, tc).epoch(1))
    resumed = EpochBatches(data, tc).stream(Position(epoch=2, batch_in_epoch=3))
    assert [b.src.tolist() for b, _ in resumed] == whole[n_first + 3 :]
    # the epochs differ in their segmentation, not only in their order
    one, two = (EpochBatches(data, tc).corpus(e) for e in (1, 2))
    assert not np.array_equal(one.src_offsets, two.src_offsets)


def test_ranks_share_one_epoch_and_count_its_tokens_alike(unigram, tmp_path, sentences):
    data = sampled_data(unigram, tmp_path, sentences, nbest=8, alpha=0.05)
    tc = TrainConfig(max_tokens=64, max_epochs=1)
    ranks = [list(EpochBatches(data, tc, rank, 2).stream(Position())) for rank in (0, 1)]
    assert len(ranks[0]) == len(ranks[1])
    assert [t for _, t in ranks[0]] == [t for _, t in ranks[1]]
    for (b0, t), (b1, _) in zip(*ranks):
        assert t == b0.n_tgt_tokens + b1.n_tgt_tokens


def test_sampling_off_builds_nothing(unigram):
    cfg = config_from_dict({})
    assert sampled_segmentations(cfg, unigram) is None


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"data": {"subword_sampling": {"nbest": 1}}}, "data.subword_sampling.nbest"),
        ({"data": {"subword_sampling": {"alpha": 0}}}, "data.subword_sampling.alpha"),
        ({"data": {"subword_sampling": {"nbst": 4}}}, "did you mean nbest"),
        (
            {"data": {"subword_sampling": {"nbest": 4}}, "tokenizer": {"type": "bpe"}},
            "needs tokenizer.type unigram",
        ),
    ],
)
def test_config_refuses_what_cannot_be_sampled(raw, key):
    with pytest.raises(ConfigError, match=key):
        config_from_dict(raw)


def test_config_default_is_off_and_a_yaml_section_sets_it():
    assert DataConfig().subword_sampling.nbest == 0
    cfg = config_from_dict({"data": {"subword_sampling": {"nbest": 16, "alpha": 0.5}}})
    assert (cfg.data.subword_sampling.nbest, cfg.data.subword_sampling.alpha) == (16, 0.5)
    assert math.isclose(cfg.to_dict()["data"]["subword_sampling"]["alpha"], 0.5)


def test_a_run_trains_on_each_epochs_segmentation(copy_config):
    from transformer_mt.config import SubwordSampling
    from transformer_mt.train import Trainer

    cfg = copy_config(max_steps=3)
    cfg.data.subword_sampling = SubwordSampling(nbest=8, alpha=0.05)
    trainer = Trainer(cfg)
    best, first = trainer.data.train, trainer.batches.corpus(1)
    differ = [i for i in range(len(best)) if not np.array_equal(best.src(i), first.src(i))]
    assert differ  # epoch 1 is not the best segmentation everywhere ...
    decode = trainer.tokenizer.src.decode
    assert all(decode(first.src(i).tolist()) == decode(best.src(i).tolist()) for i in differ)
    batch, tokens = next(trainer.batches.stream(trainer.state))
    expected = collate(first, trainer.batches.epoch(1)[0])  # ... and batches are cut from it
    assert torch.equal(batch.src, expected.src) and tokens == expected.n_tgt_tokens
    assert trainer.train() is not None and trainer.state.step == 3


def test_init_from_a_bpe_parent_with_sampling_is_refused_by_name():
    from types import SimpleNamespace

    from transformer_mt.prepare import adopt_tokenizer_config

    cfg = config_from_dict({"data": {"subword_sampling": {"nbest": 4}}})
    parent = SimpleNamespace(config=SimpleNamespace(tokenizer=TokenizerConfig(type="bpe")))
    with pytest.raises(UserError, match="parent's tokenizer is bpe.*subword_sampling.nbest: 0"):
        adopt_tokenizer_config(cfg, parent)
    unigram_parent = SimpleNamespace(config=SimpleNamespace(tokenizer=TokenizerConfig()))
    adopt_tokenizer_config(cfg, unigram_parent)
    assert cfg.tokenizer.type == "unigram"

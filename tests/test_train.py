"""Training: the loss and schedule are the paper's, and a tiny copy task is learned exactly."""

import random

import pytest
import torch

from transformer_mt.config import config_from_dict
from transformer_mt.data import read_split
from transformer_mt.tokenizer import PAD
from transformer_mt.train import Trainer, label_smoothed_loss, noam
from transformer_mt.translate import Translator


def test_loss_is_label_smoothed_cross_entropy_over_non_padding():
    """(1 - eps) * NLL(y) + eps * mean over the vocabulary of -log p, summed over real tokens."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    target = torch.randint(1, 11, (2, 5), generator=g)
    target[1, 3:] = PAD
    eps = 0.1
    logp = logits.log_softmax(-1)
    expected = 0.0
    for b in range(2):
        for t in range(5):
            if target[b, t] != PAD:
                expected += (1 - eps) * -logp[b, t, target[b, t]] + eps * -logp[b, t].mean()
    torch.testing.assert_close(label_smoothed_loss(logits, target, eps), expected)
    # Without smoothing it is the plain negative log-likelihood.
    nll = -sum(logp[b, t, target[b, t]] for b in range(2) for t in range(5) if target[b, t] != PAD)
    torch.testing.assert_close(label_smoothed_loss(logits, target, 0.0), nll)


def test_noam_schedule_matches_formula_and_peaks_at_warmup():
    d, warmup, factor = 512, 4000, 2.0
    for step in (1, 100, 3999, 4000, 4001, 20000):
        assert noam(step, d, warmup, factor) == pytest.approx(factor * d**-0.5 * min(step**-0.5, step * warmup**-1.5))
    rates = [noam(s, d, warmup, factor) for s in range(1, 3 * warmup)]
    assert rates.index(max(rates)) + 1 == warmup
    assert noam(warmup, d, warmup, factor) == pytest.approx(factor * (d * warmup) ** -0.5)


def write_copy_corpus(folder, n_train=2000, seed=0):
    """A copy task: the target is the source. Words from a tiny vocabulary, 2-6 words long."""
    rng = random.Random(seed)
    words = "red blue green black white gold".split()
    for split, n in (("train", n_train), ("valid", 60)):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) for _ in range(n)]
        for lang in ("src", "tgt"):
            (folder / f"{split}.{lang}").write_text("".join(x + "\n" for x in lines))


def tiny_config(tmp_path, **train):
    return config_from_dict({
        "data": {"src_lang": "src", "tgt_lang": "tgt", "train": str(tmp_path / "train"),
                 "valid": str(tmp_path / "valid")},
        "tokenizer": {"vocab_size": 40},
        "model": {"d_model": 64, "heads": 4, "encoder_layers": 2, "decoder_layers": 2, "d_ff": 128,
                  "dropout": 0.0, "max_positions": 64},
        "train": {"max_tokens": 1024, "warmup": 60, "lr_factor": 1.0, "log_every": 50, "valid_every": 1000,
                  "valid_bleu": False, "keep_last": 0, "seed": 3, **train},
        "output_dir": str(tmp_path / "run"),
    })


def test_learning_rate_follows_noam_per_update(tmp_path):
    write_copy_corpus(tmp_path, n_train=200)
    trainer = Trainer(tiny_config(tmp_path, max_steps=3))
    lrs = []
    for micro in zip(range(3), trainer._batches()):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.train_step([micro[1]])
    assert lrs == pytest.approx([noam(s, 64, 60, 1.0) for s in (1, 2, 3)])


@pytest.mark.slow
def test_tiny_copy_task_is_learned_exactly(tmp_path):
    write_copy_corpus(tmp_path)
    # No label smoothing: it keeps probability off the one right answer that this task has.
    cfg = tiny_config(tmp_path, max_steps=800, label_smoothing=0.0)
    trainer = Trainer(cfg)
    trainer.train()
    sources, references = read_split(cfg.data, "valid")
    hyps = Translator(trainer.model, trainer.tokenizer, cfg.decode).translate(sources, beam=1)
    exact = sum(h == r for h, r in zip(hyps, references)) / len(references)
    assert exact == 1.0, [(h, r) for h, r in zip(hyps, references) if h != r][:5]

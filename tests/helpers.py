"""Small shared helpers for the search tests (a plain module, not a test module): a random model
with peaked distributions, padded random sources, and a sequence's log-probability by one forced
pass."""

import torch

from transformer_mt.config import ModelConfig
from transformer_mt.model import Transformer
from transformer_mt.vocab import BOS, EOS, PAD


def make_model(vocab: int, seed: int, sharpen: float = 3.0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        d_model=32,
        heads=4,
        encoder_layers=1,
        decoder_layers=2,
        d_ff=64,
        dropout=0.0,
        max_positions=64,
        tie_embeddings=False,
    )
    model = Transformer(cfg, vocab, vocab, joint_vocab=True).eval()
    with torch.no_grad():  # peakier distributions than at initialisation, so that choices matter
        model.generator.weight.mul_(sharpen)
    return model


def sources(B: int, S: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (B, S), generator=g)
    src[:, -1] = EOS
    for b in range(1, B):
        src[b, S - 1 - b :] = PAD
        src[b, S - 1 - b] = EOS
    return src


def sequence_logprob(model: Transformer, src: torch.Tensor, tokens: list[int]) -> float:
    """log P(tokens + EOS | src) by one teacher-forced forward pass (no cache involved)."""
    tgt_in = torch.tensor([[BOS] + tokens])
    tgt_out = torch.tensor(tokens + [EOS])
    logp = model(src, tgt_in).log_softmax(-1)[0]  # (T, V)
    return float(logp.gather(1, tgt_out[:, None]).sum())

"""Small shared helpers (a plain module, not a test module). For the search tests: a random model
with peaked distributions, padded random sources, and a sequence's log-probability by one forced
pass. For the tests that run `tmt` as users do: a tiny corpus and config, `tmt` in a subprocess,
waiting for a file it writes, and a one-line error."""

import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from transformer_mt.cli import main
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


def tiny_model(**model) -> Transformer:
    """A random one-layer model over 20 shared pieces, with `model`'s settings: for the checks that
    look at a model's architecture, not at what it translates."""
    cfg = ModelConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, d_ff=32, **model)
    return Transformer(cfg, 20, 20, joint_vocab=True)


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


# --------------------------------------------------------------------------- tmt as users run it

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


def write_corpus(folder: Path, n_train: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", 10), ("test", 10)):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7))) for _ in range(n)]
        (folder / f"{split}.en").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
        (folder / f"{split}.de").write_text(
            "".join(x.upper() + "\n" for x in lines), encoding="utf-8"
        )
    return folder


def write_config(path: Path, corpus: Path, run: Path, **train) -> Path:
    settings = {
        "max_steps": 60,
        "valid_every": 10,
        "log_every": 5,
        "max_tokens": 512,
        "warmup": 10,
        # auto: timed
        "threads": 1,
        "keep_last": 2,
        "device": "cpu",
        "precision": "fp32",
        **train,
    }
    path.write_text(
        textwrap.dedent(f"""\
        data: {{src_lang: en, tgt_lang: de, train: {corpus}/train, valid: {corpus}/valid,
                test: {corpus}/test}}
        tokenizer: {{vocab_size: 60}}
        model: {{d_model: 32, heads: 2, encoder_layers: 1, decoder_layers: 1, d_ff: 64,
                 max_positions: 64, dropout: 0.1}}
        decode: {{beam: 2, max_len_b: 5}}
        output_dir: {run}
        train: {{{", ".join(f"{k}: {v}" for k, v in settings.items())}}}
        """),
        encoding="utf-8",
    )
    return path


def tmt(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "transformer_mt", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kw,
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"training ended early: {proc.communicate()[1][-2000:]}"
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def one_line_error(capsys, argv, *needles) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    for needle in needles:
        assert needle in last, (needle, err)

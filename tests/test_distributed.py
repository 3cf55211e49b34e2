"""Data-parallel training (torchrun + DDP, gloo on CPU) equals one process with the same global batch."""

import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from transformer_mt.cli import main

pytestmark = pytest.mark.slow


def write_setup(root: Path, run: str, extra: str = "") -> Path:
    corpus = root / "corpus"
    if not corpus.exists():
        corpus.mkdir(parents=True)
        rng = random.Random(0)
        words = "red blue green black white gold silver pink".split()
        for split, n in (("train", 400), ("valid", 8)):
            lines = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 8))) for _ in range(n)]
            (corpus / f"{split}.en").write_text("".join(x + "\n" for x in lines))
            (corpus / f"{split}.de").write_text("".join(x.upper() + "\n" for x in lines))
    cfg = root / f"{run}.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        data: {{src_lang: en, tgt_lang: de, train: {corpus}/train, valid: {corpus}/valid}}
        tokenizer: {{vocab_size: 80}}
        model: {{d_model: 32, heads: 2, encoder_layers: 1, decoder_layers: 1, d_ff: 64, dropout: 0.0,
                 max_positions: 64}}
        train: {{max_steps: 4, valid_every: 4, log_every: 2, max_tokens: 300, warmup: 4, threads: 1,
                 valid_bleu: false, device: cpu, precision: fp32, seed: 5, adam_eps: 1.0{extra}}}
        output_dir: {root / run}
        """))
    return cfg


def torchrun(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "transformer_mt", *args], capture_output=True, text=True, env=env, timeout=300)


def test_two_gloo_processes_equal_one_process_with_the_same_global_batch(tmp_path):
    ddp_cfg = write_setup(tmp_path, "ddp")
    proc = torchrun(["train", str(ddp_cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "effective batch <= 600 tokens (max_tokens 300 x accumulate 1 x 2 processes)" in proc.stderr
    # One process, two batches per update: the same batches as the two ranks together. (adam_eps 1.0 keeps
    # Adam's early updates proportional to the gradient; near 0 it would amplify rounding noise to +-lr.)
    single_cfg = write_setup(tmp_path, "single", extra=", accumulate: 2")
    (tmp_path / "single").mkdir()
    shutil.copy(tmp_path / "ddp" / "spm.model", tmp_path / "single" / "spm.model")
    assert main(["-q", "train", str(single_cfg)]) == 0
    a = torch.load(tmp_path / "ddp" / "checkpoints" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "single" / "checkpoints" / "last.pt", weights_only=True)
    assert a["step"] == b["step"] == 4  # 8 of the epoch's 9 batches: no epoch boundary inside
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], atol=1e-5, rtol=1e-4)
    # Only rank 0 wrote TensorBoard events and checkpoints.
    assert len(list((tmp_path / "ddp" / "tb").glob("events.*"))) == 1
    assert isinstance(a["rng"], list) and len(a["rng"]) == 2


def test_two_process_run_resumed_equals_one_never_stopped(tmp_path):
    # dropout > 0: the per-rank random streams must come back too; 6 updates x 2 ranks cross an epoch (9 batches).
    for name in ("whole", "parts"):
        cfg = write_setup(tmp_path, name)
        cfg.write_text(cfg.read_text().replace("dropout: 0.0", "dropout: 0.2").replace("max_steps: 4", "max_steps: 6"))
    first = torchrun(["train", str(tmp_path / "whole.yaml")])
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "parts").mkdir()  # the same SentencePiece model: this test is about the training state
    shutil.copy(tmp_path / "whole" / "spm.model", tmp_path / "parts" / "spm.model")
    part = torchrun(["train", str(tmp_path / "parts.yaml"), "--set", "train.max_steps=3"])
    assert part.returncode == 0, part.stderr[-3000:]
    assert torch.load(tmp_path / "parts" / "checkpoints" / "last.pt", weights_only=True)["step"] == 3
    rest = torchrun(["train", str(tmp_path / "parts.yaml"), "--resume"])
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from" in rest.stderr
    a = torch.load(tmp_path / "whole" / "checkpoints" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "parts" / "checkpoints" / "last.pt", weights_only=True)
    assert a["step"] == b["step"] == 6
    assert a["train_state"]["epoch"] == b["train_state"]["epoch"] >= 2  # the resume crossed an epoch boundary
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0)


def test_training_leaves_the_process_group_so_gloo_threads_do_not_abort_at_exit(tmp_path):
    # A rank that exits with the group alive can die in gloo's teardown ("terminate called without an
    # active exception", SIGABRT: pytorch/pytorch#190489). A one-rank gloo group stands in for torchrun here.
    import torch.distributed as dist
    from transformer_mt.config import load_config
    from transformer_mt.train import train

    cfg = write_setup(tmp_path, "one")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        summary = train(load_config(cfg, ["train.max_steps=2"]))
        assert summary["steps"] == 2 and summary["rank"] == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

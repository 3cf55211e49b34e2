"""Data-parallel training (torchrun + DDP, gloo on CPU) equals one process with the same global
batch."""

import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from transformer_mt.cli import main
from transformer_mt.distributed import Dist


def write_setup(root: Path, run: str, extra: str = "") -> Path:
    corpus = root / "corpus"
    if not corpus.exists():
        corpus.mkdir(parents=True)
        rng = random.Random(0)
        words = "red blue green black white gold silver pink".split()
        for split, n in (("train", 400), ("valid", 8)):
            lines = [
                " ".join(rng.choice(words) for _ in range(rng.randint(2, 8))) for _ in range(n)
            ]
            (corpus / f"{split}.en").write_text("".join(x + "\n" for x in lines))
            (corpus / f"{split}.de").write_text("".join(x.upper() + "\n" for x in lines))
    cfg = root / f"{run}.yaml"
    cfg.write_text(
        textwrap.dedent(f"""\
        data: {{src_lang: en, tgt_lang: de, train: {corpus}/train, valid: {corpus}/valid}}
        tokenizer: {{vocab_size: 80}}
        model: {{d_model: 32, heads: 2, encoder_layers: 1, decoder_layers: 1, d_ff: 64,
                 dropout: 0.0, max_positions: 64}}
        train: {{max_steps: 4, valid_every: 4, log_every: 2, max_tokens: 300, warmup: 4, threads: 1,
                 valid_bleu: false, device: cpu, precision: fp32, seed: 5, adam_eps: 1.0{extra}}}
        output_dir: {root / run}
        """)
    )
    return cfg


def torchrun(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "transformer_mt",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.slow
def test_two_gloo_processes_equal_one_process_with_the_same_global_batch(tmp_path):
    ddp_cfg = write_setup(tmp_path, "ddp")
    proc = torchrun(["train", str(ddp_cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "effective batch <= 600 tokens (max_tokens 300 x accumulate 1 x 2 processes)" in proc.stderr
    )
    # One process, two batches per update: the same batches as the two ranks together. (adam_eps 1.0
    # keeps Adam's early updates proportional to the gradient; near 0 it would amplify rounding
    # noise to +-lr.)
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
    # Issue 22, item 16: each rank draws from its own random stream (its own dropout masks).
    assert not torch.equal(a["rng"][0]["torch"], a["rng"][1]["torch"])


@pytest.mark.slow
def test_two_process_run_resumed_equals_one_never_stopped(tmp_path):
    # dropout > 0: the per-rank random streams must come back too; 6 updates x 2 ranks cross an
    # epoch (9 batches).
    for name in ("whole", "parts"):
        cfg = write_setup(tmp_path, name)
        cfg.write_text(
            cfg.read_text()
            .replace("dropout: 0.0", "dropout: 0.2")
            .replace("max_steps: 4", "max_steps: 6")
        )
    first = torchrun(["train", str(tmp_path / "whole.yaml")])
    assert first.returncode == 0, first.stderr[-3000:]
    # the same SentencePiece model: this test is about the training state
    (tmp_path / "parts").mkdir()
    shutil.copy(tmp_path / "whole" / "spm.model", tmp_path / "parts" / "spm.model")
    part = torchrun(["train", str(tmp_path / "parts.yaml"), "--set", "train.max_steps=3"])
    assert part.returncode == 0, part.stderr[-3000:]
    assert (
        torch.load(tmp_path / "parts" / "checkpoints" / "last.pt", weights_only=True)["step"] == 3
    )
    rest = torchrun(["train", str(tmp_path / "parts.yaml"), "--resume"])
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from" in rest.stderr
    a = torch.load(tmp_path / "whole" / "checkpoints" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "parts" / "checkpoints" / "last.pt", weights_only=True)
    assert a["step"] == b["step"] == 6
    # the resume crossed an epoch boundary
    assert a["train_state"]["epoch"] == b["train_state"]["epoch"] >= 2
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0)


@pytest.mark.slow
def test_training_leaves_the_process_group_on_every_way_out(tmp_path):
    # After a barrier, so that no rank goes on while rank 0 still writes. A one-rank gloo group
    # stands in for torchrun here.
    import torch.distributed as dist

    from transformer_mt.config import load_config
    from transformer_mt.train import train

    cfg = write_setup(tmp_path, "one")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        summary = train(load_config(cfg, ["train.max_steps=2"]))
        assert summary["steps"] == 2 and summary["rank"] == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_a_torchrun_rank_ends_without_python_finalization_and_loses_no_output(tmp_path):
    """Two-rank runs aborted about once in a hundred after finishing: a gloo worker thread still
    freeing the last collectives' tensors took the GIL during finalization (gdb: pthread_exit from
    take_gil under ~AsyncBarrierWork, then std::terminate). A rank now ends with os._exit; a process
    that joined no group exits normally. The atexit line shows whether finalization ran; stdout is
    a pipe (block-buffered), so the rank's line shows that it was flushed."""
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent("""\
        import atexit, sys
        import torch
        from transformer_mt.distributed import exit_process, init_distributed, leave_distributed

        atexit.register(lambda: print("finalized"))
        d = init_distributed("cpu")
        t = torch.ones(1)
        if d.world > 1:
            torch.distributed.all_reduce(t)
        print(f"rank {d.rank} of {d.world} summed {t.item():.0f}")
        leave_distributed(clean=True)
        exit_process(int(sys.argv[1]))
        """)
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["OMP_NUM_THREADS"] = "1"
    ranks = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + [str(script), "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    # the ranks share one pipe: their lines may come interleaved
    said = sorted(re.findall(r"rank \d of \d summed \d|finalized", ranks.stdout))
    assert said == ["rank 0 of 2 summed 2", "rank 1 of 2 summed 2"], ranks.stdout
    alone = subprocess.run(
        [sys.executable, str(script), "3"], capture_output=True, text=True, env=env, timeout=300
    )
    assert alone.returncode == 3
    assert alone.stdout.splitlines() == ["rank 0 of 1 summed 1", "finalized"]


def test_each_rank_draws_its_own_dropout_masks_and_rank_0_those_of_one_process(monkeypatch):
    """Issue 22, item 16: every rank was seeded alike, so all ranks dropped the same units.
    init_runtime seeds seed + rank once the process group exists."""
    from transformer_mt import prepare
    from transformer_mt.config import TrainConfig
    from transformer_mt.distributed import seed_everything

    def masks(rank: int) -> torch.Tensor:
        monkeypatch.setattr(prepare, "init_distributed", lambda device: Dist(rank, 2))
        prepare.init_runtime(TrainConfig(seed=5, device="cpu"))
        return torch.nn.functional.dropout(torch.ones(64), 0.5)  # (64,) a dropout mask, scaled

    rank0, rank1 = masks(0), masks(1)
    assert not torch.equal(rank0, rank1)
    assert torch.equal(masks(0), rank0)  # reproducible
    torch.manual_seed(5)
    # rank 0 = a single process
    assert torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), rank0)
    seed_everything(5, 1)
    assert torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), rank1)


@pytest.mark.parametrize("world", [1, 2])
def test_ranks_agree_on_stopping_at_log_and_validation_steps_only(tmp_path, monkeypatch, world):
    """Issue 22, item 16: `agree` (an all-reduce and a host sync under DDP) ran after every update.
    Now at most once per log window and validation (and once per validation for early stopping);
    with one process no collective at all. A two-rank group is faked: the all-reduces count calls
    and change nothing."""
    import torch.distributed as dist

    from transformer_mt import train as train_module
    from transformer_mt.config import load_config
    from transformer_mt.distributed import rng_state

    collectives, agreements, real_agree = [], [], train_module.agree
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **kw: collectives.append(1))
    monkeypatch.setattr(
        dist,
        "all_gather_object",
        lambda out, obj: out.__setitem__(slice(None), [rng_state()] * world),
    )
    monkeypatch.setattr(train_module, "agree", lambda *a: agreements.append(1) or real_agree(*a))
    steps, log_every, valid_every = 12, 3, 6
    cfg = write_setup(tmp_path, "agree")
    trainer = train_module.Trainer(
        load_config(
            cfg,
            [
                f"train.max_steps={steps}",
                f"train.log_every={log_every}",
                f"train.valid_every={valid_every}",
                "train.max_minutes=60",
            ],
        )
    )
    trainer.dist = Dist(0, world)
    assert trainer.train()["steps"] == steps
    validations = steps // valid_every
    if world == 1:
        assert not collectives  # agree is free: one process checks its flags at every update
    else:
        # was one per update, and one per validation
        assert len(agreements) <= steps // log_every + validations
        # per log step: the agreement and the loss's sum; per validation: the early-stop agreement
        assert len(collectives) <= 2 * (steps // log_every) + validations

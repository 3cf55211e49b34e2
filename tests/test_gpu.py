"""The CUDA paths: training in each GPU precision, our model on the GPU against the CPU, and DDP
over NCCL.

Skipped without a CUDA device (CI has none); run on a GPU machine with `pytest tests/test_gpu.py`.
"""

import math

import pytest
import torch

from transformer_mt.config import ModelConfig
from transformer_mt.model import Transformer
from transformer_mt.train import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32", "auto"])
def test_training_on_cuda_keeps_fp32_weights_in_each_precision(copy_config, precision):
    trainer = Trainer(copy_config(max_steps=4, valid_every=4, precision=precision, device="cuda"))
    expected = "bf16" if precision == "auto" and torch.cuda.is_bf16_supported() else precision
    assert trainer.precision == expected and trainer.device.type == "cuda"
    assert trainer.scaler.is_enabled() == (expected == "fp16")  # the grad scaler only for fp16
    summary = trainer.train()
    assert summary["steps"] == 4 and math.isfinite(summary["best_score"])
    assert all(p.dtype == torch.float32 and p.is_cuda for p in trainer.model.parameters())


def test_our_model_computes_the_same_on_cuda_as_on_the_cpu():
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(d_model=64, heads=4, encoder_layers=2, decoder_layers=2, d_ff=128, dropout=0.0),
        50,
        50,
        joint_vocab=True,
    ).eval()
    src, tgt = torch.randint(4, 50, (3, 9)), torch.randint(4, 50, (3, 7))
    src[0, 6:] = 0  # padding in one row: the masks must agree too
    with torch.no_grad():
        cpu = model(src, tgt)
        gpu = model.cuda()(src.cuda(), tgt.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, atol=1e-4, rtol=1e-4)


def test_the_ranks_collectives_run_over_nccl_on_gpu_tensors():
    """NCCL reduces only CUDA tensors: agree, agree_min and global_sum must build theirs on the
    run's device. One GPU holds one NCCL rank, so the group has one process, and Dist claims two to
    take the collective path."""
    import torch.distributed as dist

    from transformer_mt.distributed import Dist, agree, agree_min, global_sum

    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    try:
        d, device = Dist(0, 2, 0), torch.device("cuda", 0)
        assert agree(d, device, False, True) == (False, True)
        assert agree_min(d, device, 17) == 17
        assert global_sum(d, torch.tensor(2.5, device=device)) == 2.5
    finally:
        dist.destroy_process_group()

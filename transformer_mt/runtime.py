"""Where and in what precision the model runs: device choice, precision -> dtype, autocast.

One place for training and inference, so that both resolve `auto` the same way.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device(name: str = "auto") -> torch.device:
    """CUDA, then Apple MPS, then CPU (or the device named)."""
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_precision(precision: str, device: torch.device) -> str:
    """auto: bf16 on GPUs that support it, fp16 (with a grad scaler) on older GPUs, fp32 elsewhere."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Mixed-precision autocast for a resolved precision (fp32: none)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def inference_model(model: torch.nn.Module, precision: str, device: torch.device) -> tuple[torch.nn.Module, str]:
    """The model to decode with, in eval mode, and the precision it runs in.

    A bf16 (or, on GPUs, fp16) run decodes with a copy of the model wholly in that dtype, as fairseq's --fp16
    generation does: no casts per operation and half the bytes through every op and the KV cache
    (BENCHMARKS.md has its speed and BLEU). The caller's model is left as it is, so training can go on.
    """
    precision = resolve_precision(precision, device)
    if precision == "int8":
        return quantize_linear(model), precision
    if precision == "fp16" and device.type != "cuda":  # a GPU fp16 run decoded elsewhere
        precision = "fp32"
    if next(model.parameters()).dtype != DTYPES[precision]:
        model = copy.deepcopy(model).to(DTYPES[precision])
    return model.eval(), precision


def quantize_linear(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the model whose nn.Linear layers hold int8 weights and quantize their inputs on the fly
    (dynamic quantization, CPU only): 4x smaller weights and int8 matrix products; embeddings, layer norms
    and attention stay fp32. One scale per output row (per channel), as CTranslate2's int8 does: one scale
    per matrix cost a half-trained demo model 0.7 BLEU, per row 0.15. torch.ao's eager API is deprecated
    for torchao but ships with torch."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation notice, on every call
        return quantize_dynamic(copy.deepcopy(model).float().eval(), {torch.nn.Linear: per_channel_dynamic_qconfig},
                                dtype=torch.qint8)


def matmul_gflops(device: torch.device, dtype: torch.dtype, m: int, k: int, n: int,
                  seconds: float = 0.3) -> float:
    """GFLOP/s of an (m, k) @ (k, n) matmul in `dtype`, timed for about `seconds`: the MFU denominator.

    The operands are constants, not random: a resumed run must draw exactly the random numbers that an
    uninterrupted run draws.
    """
    a = torch.full((m, k), 0.5, device=device, dtype=dtype)
    b = torch.full((k, n), 0.5, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        count += 1
    if device.type == "cuda":
        torch.cuda.synchronize()  # a host sync: the queued matmuls must finish inside the timing
    return 2.0 * m * k * n * count / (time.perf_counter() - t0) / 1e9

"""Where and in what precision the model runs: device choice, precision -> dtype, autocast, and
the attention kernel a CPU trains fastest with.

One place for training and inference, so that both resolve `auto` the same way.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

log = logging.getLogger("transformer_mt")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# A training precision besides those: fp32, except the output projection (tokens x vocabulary, the
# largest matrix product of a small model), which runs in bf16 autocast (Transformer.output_dtype).
# On a CPU with fast bf16 matrix units but slow bf16 everything-else it is the fastest of the three.
BF16_OUTPUT = "bf16-output"


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype most of the model computes in under a resolved precision."""
    return torch.float32 if precision == BF16_OUTPUT else DTYPES[precision]


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
    """auto: bf16 on GPUs that support it, fp16 (with a grad scaler) on older GPUs, fp32
    elsewhere."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Mixed-precision autocast for a resolved precision (fp32 and bf16-output: none)."""
    if precision in ("fp32", BF16_OUTPUT):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def inference_model(
    model: torch.nn.Module, precision: str, device: torch.device
) -> tuple[torch.nn.Module, str]:
    """The model to decode with, in eval mode, and the precision it runs in.

    A bf16 (or, on GPUs, fp16) run decodes with a copy of the model wholly in that dtype, as
    fairseq's --fp16 generation does: no casts per operation and half the bytes through every op and
    the KV cache (BENCHMARKS.md has its speed and BLEU). The caller's model is left as it is, so
    training can go on.
    """
    precision = resolve_precision(precision, device)
    if precision == "int8":
        return quantize_linear(model), precision
    if precision == "fp16" and device.type != "cuda":  # a GPU fp16 run decoded elsewhere
        precision = "fp32"
    # its weights are fp32; the bf16 output layer only sped up training
    if precision == BF16_OUTPUT:
        precision = "fp32"
    if next(model.parameters()).dtype != DTYPES[precision]:
        model = copy.deepcopy(model).to(DTYPES[precision])
    return model.eval(), precision


def quantize_linear(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the model whose nn.Linear layers hold int8 weights and quantize their inputs on the
    fly (dynamic quantization, CPU only): 4x smaller weights and int8 matrix products; embeddings,
    layer norms and attention stay fp32. One scale per output row (per channel), as CTranslate2's
    int8 does: one scale per matrix cost a half-trained demo model 0.7 BLEU, per row 0.15.
    torch.ao's eager API is deprecated for torchao but ships with torch."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation notice, on every call
        return quantize_dynamic(
            copy.deepcopy(model).float().eval(),
            {torch.nn.Linear: per_channel_dynamic_qconfig},
            dtype=torch.qint8,
        )


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(
                next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
            )
    except OSError:
        return set()


# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) at or above AVX512_CORE_BF16; any other cap leaves it
# without bf16.
_ONEDNN_BF16_ISAS = ("BF16", "FP16", "AMX", "AVX10")


def cpu_bf16_obstacle() -> str:
    """Why bf16 matrix products would be emulated on this CPU ("" when they are native): no
    avx512_bf16 or amx_bf16 flag, or torch's dispatch (ATEN_CPU_CAPABILITY) or oneDNN
    (ONEDNN_MAX_CPU_ISA) capped below AVX-512."""
    flags = cpu_flags()
    if not flags & {"avx512_bf16", "amx_bf16"}:
        return "the CPU has no avx512_bf16 or amx_bf16 flag"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.upper().startswith("AVX512"):
        return f"torch dispatches {capability} kernels (ATEN_CPU_CAPABILITY)"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa not in ("", "ALL", "DEFAULT") and not any(tag in isa for tag in _ONEDNN_BF16_ISAS):
        return f"ONEDNN_MAX_CPU_ISA={isa}"
    return ""


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) and torch and oneDNN may
    use it."""
    return not cpu_bf16_obstacle()


def fastest_cpu_precision(
    step: Callable[[str], None],
    repeats: int = 2,
    candidates: tuple[str, ...] = ("fp32", "bf16"),
    *,
    slower: float = 2.0,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[str, dict[str, float], dict[str, str]]:
    """The candidate precision that runs `step(precision)` (one training step of the model) fastest
    here, the seconds each took (the best of `repeats` after a warm-up), and the candidates skipped,
    with why. bf16 autocast is ~1.3x faster on CPUs whose AMX units multiply bf16 (Intel Sapphire
    Rapids on), and can be slower where bf16 is only converted (AVX512-BF16 without AMX), where bf16
    for the output layer alone can still pay: measuring beats guessing. But where bf16 is emulated
    (no AVX512-BF16/AMX: 24x slower than fp32 on an AVX2 EPYC) the bf16 candidates are not timed at
    all, and a candidate whose warm-up step takes over `slower` times the first candidate's (fp32's)
    is dropped after it: the probe costs a few steps, not a minute. With one candidate left, nothing
    is timed (`seconds` is empty)."""
    obstacle = cpu_bf16_obstacle() if any("bf16" in p for p in candidates[1:]) else ""
    skipped = {p: f"no native bf16: {obstacle}" for p in candidates[1:] if obstacle and "bf16" in p}
    timed = [p for p in candidates if p not in skipped]
    if len(timed) == 1:
        return timed[0], {}, skipped
    warm: dict[str, float] = {}
    # the probe's dropout must not shift the run's random stream
    with torch.random.fork_rng(devices=[]):
        for precision in list(timed):
            start = clock()
            step(precision)  # warm-up: first calls allocate and pick kernels
            warm[precision] = clock() - start
            if precision != candidates[0] and warm[precision] > slower * warm[candidates[0]]:
                skipped[precision] = (
                    f"its first step took {1000 * warm[precision]:.0f} ms, over {slower:g}x "
                    f"{candidates[0]}'s {1000 * warm[candidates[0]]:.0f} ms"
                )
                timed.remove(precision)
        seconds = best_seconds(step, timed, repeats, clock)
    return min(seconds, key=seconds.get), seconds, skipped


def best_seconds(
    step: Callable[[str], None],
    candidates: list[str] | tuple[str, ...],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """The fastest of `repeats` timings of `step(candidate)` for each candidate, taken in turns so
    that a slow spell of a shared machine hits all of them alike."""
    seconds: dict[str, float] = {}
    for _ in range(repeats):
        for candidate in candidates:
            start = clock()
            step(candidate)
            seconds[candidate] = min(seconds.get(candidate, math.inf), clock() - start)
    return seconds


# From the most exact to the least: ranks that measured differently train in the most exact of their
# choices.
CPU_PRECISIONS = ("fp32", BF16_OUTPUT, "bf16")


def choose_cpu_precision(
    step: Callable[[str], None],
    agree_min: Callable[[int], int] = lambda i: i,
    timings: dict[str, float] | None = None,
) -> str:
    """precision auto on a CPU: time `step(precision)`, a training step of the run's model on a
    batch of the run's size, in fp32, in bf16 autocast and in fp32 with a bf16 output layer, and
    train in the fastest, but in fp32 unless that is at least 10% faster (fp32 is exact, so it wins
    near-ties and the choice does not flip on timing noise). `agree_min` takes this process's index
    into CPU_PRECISIONS and returns the smallest over all ranks. `timings`, if given, receives the
    ms a step each timed precision took (what the log line says; runs keep it in their state)."""
    fastest, seconds, skipped = fastest_cpu_precision(step, candidates=CPU_PRECISIONS)
    if timings is not None:
        timings.update({p: round(1000 * s, 1) for p, s in seconds.items()})
    mine = fastest if seconds and seconds[fastest] < 0.9 * seconds["fp32"] else "fp32"
    choice = CPU_PRECISIONS[agree_min(CPU_PRECISIONS.index(mine))]
    timed = ", ".join(f"{1000 * s:.0f} ms in {p}" for p, s in seconds.items())
    log.info(
        "precision auto: %s%s; training in %s",
        f"a training step took {timed} on this CPU" if timed else "nothing timed",
        "".join(f"; {p} skipped ({why})" for p, why in skipped.items()),
        choice,
    )
    return choice


def training_precision(
    requested: str,
    device: torch.device,
    resumed: str = "",
    choose_on_cpu: Callable[[], str] = lambda: "fp32",
) -> str:
    """The precision a run trains in (measured_choice; auto off a CPU: resolve_precision's)."""
    return measured_choice(
        "precision", requested, device, resumed, choose_on_cpu, resolve_precision(requested, device)
    )


def measured_choice(
    setting: str,
    requested: str,
    device: torch.device,
    resumed: str,
    choose_on_cpu: Callable[[], str],
    elsewhere: str,
) -> str:
    """What a run's train.`setting` (precision, attention) resolves to: as asked unless `auto`; an
    auto run being resumed keeps the choice it began with (`resumed`), so one run never mixes two;
    auto on a CPU is measured (`choose_on_cpu`, once); on other devices `elsewhere`."""
    if requested != "auto":
        return requested
    if resumed:
        log.info("%s auto: %s, as the run being resumed trained with", setting, resumed)
        return resumed
    return choose_on_cpu() if device.type == "cpu" else elsewhere


# scaled_dot_product_attention's kernels a run can train with: torch's own choice ("fused": its
# flash kernel on a CPU) or "math", softmax(QK^T / sqrt(d_k)) V in plain tensor ops.
ATTENTION_KERNELS = ("fused", "math")


def attention_kernel(kernel: str) -> contextlib.AbstractContextManager:
    """The context in which F.scaled_dot_product_attention runs `kernel` (one of
    ATTENTION_KERNELS); its backward follows the forward's choice."""
    return math_attention() if kernel == "math" else contextlib.nullcontext()


@contextlib.contextmanager
def math_attention() -> Iterator[None]:
    """SDPA's math kernel, in its inputs' precision. By default it casts bf16 (and fp16) queries,
    keys and values to fp32 and its output back, nine casts a call with their gradients'. Without
    them it runs as autocast runs the rest of the model: bf16 matmuls with fp32 accumulation, the
    softmax computed in fp32 and stored in bf16. No effect on fp32 inputs. The flag is
    process-wide; its previous value comes back."""
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)


def choose_cpu_attention(
    step: Callable[[str], None],
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    *,
    precision: str = "fp32",
) -> str:
    """train.attention auto on a CPU: time `step(kernel)`, attention's forward and backward at the
    run's shapes in `precision`, with each kernel, and train with math only where it is at least 10%
    faster. At Multi30k's ~25 tokens a sentence on an AVX2-only EPYC, math took ~5.2 ms to flash's
    ~8.7 after an explicit torch.set_num_threads, and the two were level without it; an earlier A/B
    on an AVX-512 one found flash the faster in fp32. In bf16 on a Xeon with AMX, flash's backward
    took ~11 ms a call to fp32's ~1 (docs/multi30k.md)."""
    for kernel in ATTENTION_KERNELS:
        step(kernel)  # warm-up
    seconds = best_seconds(step, ATTENTION_KERNELS, repeats, clock)
    choice = "math" if seconds["math"] < 0.9 * seconds["fused"] else "fused"
    log.info(
        "attention auto: forward and backward in %s took %s on this CPU; for %s: %s",
        precision,
        ", ".join(f"{1000 * s:.2f} ms {kernel}" for kernel, s in seconds.items()),
        precision,
        choice,
    )
    return choice


def set_threads(n: int) -> None:
    """torch.set_num_threads(n), unless torch already runs n threads. On an AVX2-only EPYC the
    call itself, with the 2 threads torch had chosen, slowed torch's flash attention kernel for CPUs
    (forward and backward at Multi30k's shapes: ~8 ms against ~6; the math kernel's unchanged;
    docs/multi30k.md), so a count torch has already is left alone."""
    if n != torch.get_num_threads():
        torch.set_num_threads(n)


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve every block from its heap and keep freed memory for reuse
    (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=1 GiB). By default a block above 32 MB (a batch's
    logits) is mmap'ed and unmapped every step, and the kernel zero-fills its pages again each time:
    on a 2-core CPU run that was ~100,000 minor page faults a second. Linux with glibc only; False
    where not applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # musl, or no libc.so.6
        return False


ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def keep_onednn_kernels(capacity: int = 65536) -> bool:
    """Let oneDNN keep up to `capacity` compiled kernels (its default: 1,024), unless the user set
    ONEDNN_PRIMITIVE_CACHE_CAPACITY. bf16 on a CPU runs through oneDNN, which compiles a kernel for
    each matrix shape, and training's length-bucketed batches bring new shapes for thousands of
    steps: with 1,024 it evicts kernels it needs again. A d 256 model in bf16 on a Xeon with AMX
    trained 1.09x faster with 65,536 (500 updates, ABBA; docs/multi30k.md). oneDNN reads the
    variable when it makes its first kernel: call this before the first bf16 matrix product."""
    if ONEDNN_CACHE in os.environ:
        return False
    os.environ[ONEDNN_CACHE] = str(capacity)
    log.debug("oneDNN may keep %d compiled kernels (%s)", capacity, ONEDNN_CACHE)
    return True


def minor_faults() -> int:
    """Minor page faults of this process so far (/proc/self/stat field 10; 0 where there is no
    /proc)."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0


def matmul_gflops(
    device: torch.device, dtype: torch.dtype, m: int, k: int, n: int, seconds: float = 0.3
) -> float:
    """GFLOP/s of an (m, k) @ (k, n) matmul in `dtype`, timed for about `seconds`: the MFU
    denominator.

    The operands are constants, not random: a resumed run must draw exactly the random numbers that
    an uninterrupted run draws.
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


class Meter:
    """Loss, target tokens and FLOPs of the steps since the last log line; the loss stays on the
    device."""

    def __init__(self, device: torch.device, first_step: int, peak_gflops: float):
        self.loss, self.peak_gflops = torch.zeros((), device=device), peak_gflops
        self.reset(first_step)

    def reset(self, first_step: int) -> None:
        self.loss.zero_()
        self.tokens, self.flops = 0, 0.0
        self.start, self.first_step = time.perf_counter(), first_step

    def add(self, loss: torch.Tensor, tokens: int, flops: float) -> None:
        self.loss += loss
        self.tokens += tokens
        self.flops += flops

    def log(self, step: int, loss: float, lr: float, bar: tqdm, writer: Any, **extra: str) -> None:
        """Show loss, lr, tokens/s and MFU on the bar and in the event log; start the next
        window."""
        seconds = max(time.perf_counter() - self.start, 1e-9)
        # MFU per device
        tok_s, mfu = self.tokens / seconds, self.flops / seconds / 1e9 / self.peak_gflops
        bar.set_postfix(
            loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", mfu=f"{mfu:.0%}", **extra
        )
        for name, value in (("loss", loss), ("lr", lr), ("tokens_per_sec", tok_s), ("mfu", mfu)):
            writer.add_scalar(f"train/{name}", value, step)
        self.reset(step + 1)


class SignalScope:
    """While entered (in the main thread: signals reach no other), SIGINT and SIGTERM go to
    `handler`; the handlers before come back on exit."""

    previous: dict[int, Any]

    def handler(self, signum: int, frame: Any) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {
                sig: signal.signal(sig, self.handler) for sig in (signal.SIGINT, signal.SIGTERM)
            }
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, h in self.previous.items():
            signal.signal(sig, h)


class StopSignals(SignalScope):
    """SIGINT/SIGTERM ask the loop to finish its step and write last.pt (`caught` names the signal);
    a second one stops at once, unless it comes within `grace` seconds of the first (an ensemble's
    member may be signalled directly and through its parent: one request). Outside the main thread
    (no signals there) it does nothing."""

    def __init__(self, grace: float = 0.0) -> None:
        self.caught: str | None = None
        self.grace, self.first = grace, 0.0

    def handler(self, signum: int, frame: Any) -> None:
        if self.caught is not None:
            if time.monotonic() - self.first < self.grace:
                return
            raise KeyboardInterrupt
        self.caught, self.first = signal.Signals(signum).name, time.monotonic()
        message = (
            f"tmt: {self.caught}: finishing this step and writing last.pt (press Ctrl-C again to "
            "stop at once)"
        )
        try:
            tqdm.write(message)
        except RuntimeError:  # the signal came mid-write to the same buffered stream: unbuffered
            os.write(sys.stderr.fileno(), (message + "\n").encode())

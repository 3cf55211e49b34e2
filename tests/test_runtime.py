"""Issue 16's CPU levers: precision `auto` measured at start-up, malloc keeping freed memory, and
oneDNN keeping its compiled bf16 kernels."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer_mt import prepare, runtime
from transformer_mt.runtime import fastest_cpu_precision, minor_faults

CPU = torch.device("cpu")


class FakeSteps:
    """A step function whose cost per precision is read off a fake clock: each call advances it by
    that cost."""

    def __init__(self, costs: dict[str, float]):
        self.costs, self.now, self.calls = costs, 0.0, []

    def clock(self) -> float:
        return self.now

    def __call__(self, precision: str) -> None:
        self.calls.append(precision)
        torch.rand(100)  # a step draws random numbers (dropout)
        self.now += self.costs[precision]


@pytest.fixture
def native_bf16(monkeypatch):
    """A CPU with AVX512-BF16 whose torch and oneDNN may use it (whatever this machine is)."""
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)


@pytest.mark.parametrize(
    "costs, faster",
    [({"fp32": 0.03, "bf16": 0.02}, "bf16"), ({"fp32": 0.02, "bf16": 0.03}, "fp32")],
)
def test_the_faster_precision_wins_and_the_random_stream_is_untouched(native_bf16, costs, faster):
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    steps = FakeSteps(costs)
    choice, seconds, skipped = fastest_cpu_precision(steps, repeats=2, clock=steps.clock)
    assert choice == faster and seconds == pytest.approx(costs) and not skipped
    # one warm-up and two timed each
    assert steps.calls.count("fp32") == steps.calls.count("bf16") == 3
    # the probe's draws did not shift the run's
    torch.testing.assert_close(torch.rand(3), expected_next)


@pytest.mark.parametrize(
    "flags, capability, onednn_isa, why",
    [
        ({"avx2", "fma"}, "AVX2", None, "no avx512_bf16 or amx_bf16"),  # an AVX2-only EPYC
        # ATEN_CPU_CAPABILITY=avx2
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX2", None, "ATEN_CPU_CAPABILITY"),
        ({"avx2", "avx512f", "amx_bf16"}, "AVX512", "AVX2", "ONEDNN_MAX_CPU_ISA=AVX2"),
        # no BF16
        (
            {"avx2", "avx512f", "avx512_bf16"},
            "AVX512",
            "avx512_core",
            "ONEDNN_MAX_CPU_ISA=AVX512_CORE",
        ),
    ],
)
def test_bf16_is_not_timed_where_the_cpu_emulates_it(
    monkeypatch, flags, capability, onednn_isa, why
):
    """Issue 22: bf16 steps took 4.5 s against fp32's 0.19 s on an AVX2 EPYC; the probe must not run
    them."""
    monkeypatch.setattr(runtime, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    if onednn_isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_isa)
    assert not runtime.cpu_has_native_bf16() and why in runtime.cpu_bf16_obstacle()
    steps = FakeSteps({"fp32": 1.0, "bf16-output": 0.5, "bf16": 0.1})
    choice, seconds, skipped = fastest_cpu_precision(
        steps, candidates=("fp32", "bf16-output", "bf16"), clock=steps.clock
    )
    assert steps.calls == []  # no warm-up of a bf16 candidate, and fp32 alone left: nothing to time
    assert choice == "fp32" and seconds == {}
    assert set(skipped) == {"bf16-output", "bf16"} and all(
        why in reason for reason in skipped.values()
    )


@pytest.mark.parametrize(
    "capability, onednn_isa",
    [
        ("AVX512", None),
        ("AVX512", "ALL"),
        ("AVX512", "AVX512_CORE_AMX"),
        ("AVX512", "AVX512_CORE_BF16"),
    ],
)
def test_native_bf16_needs_the_flag_and_no_cap_below_it(monkeypatch, capability, onednn_isa):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx512f", "amx_bf16"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    if onednn_isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_isa)
    assert runtime.cpu_has_native_bf16() and runtime.cpu_bf16_obstacle() == ""


def test_a_candidate_whose_first_step_is_slow_is_dropped_after_it(native_bf16):
    """The probe is capped: a warm-up step over 2x fp32's ends that candidate's timing (fake clock,
    no real time)."""
    steps = FakeSteps({"fp32": 1.0, "bf16-output": 0.8, "bf16": 2.5})
    choice, seconds, skipped = fastest_cpu_precision(
        steps, candidates=("fp32", "bf16-output", "bf16"), clock=steps.clock
    )
    assert steps.calls.count("bf16") == 1  # its warm-up only
    assert steps.calls.count("fp32") == steps.calls.count("bf16-output") == 3
    assert choice == "bf16-output" and set(seconds) == {"fp32", "bf16-output"}
    assert (
        list(skipped) == ["bf16"] and "2500 ms" in skipped["bf16"] and "2x fp32" in skipped["bf16"]
    )
    assert steps.now == pytest.approx(3 * 1.0 + 3 * 0.8 + 2.5)  # what the probe cost


@pytest.mark.parametrize(
    "bf16_seconds, output_seconds, chosen",
    [
        (0.5, 0.8, "bf16"),
        (0.95, 0.97, "fp32"),
        (1.2, 1.1, "fp32"),
        (1.2, 0.8, "bf16-output"),
        (0.85, 0.7, "bf16-output"),
    ],
)
def test_auto_takes_a_bf16_precision_only_when_clearly_faster(
    monkeypatch, caplog, bf16_seconds, output_seconds, chosen
):
    """The fastest of fp32, bf16 and bf16-output (fp32 with a bf16 output layer), but fp32 unless
    10% slower."""
    from transformer_mt.config import ModelConfig, TrainConfig
    from transformer_mt.model import Transformer

    seconds = {"fp32": 1.0, "bf16": bf16_seconds, "bf16-output": output_seconds}
    monkeypatch.setattr(
        runtime,
        "fastest_cpu_precision",
        lambda step, **kw: (min(seconds, key=seconds.get), seconds, {}),
    )
    model = Transformer(
        ModelConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, d_ff=32), 30, 30, True
    )
    with caplog.at_level("INFO", logger="transformer_mt"):
        assert (
            runtime.choose_cpu_precision(prepare.cpu_probe_step(model, TrainConfig(), CPU))
            == chosen
        )
    assert f"training in {chosen}" in caplog.text and "1000 ms in fp32" in caplog.text


def probe_on_a_fake_clock(monkeypatch, model, max_tokens: int, costs: dict[str, float]):
    """runtime.choose_cpu_precision over the real probe step of `model` (train.cpu_probe_step),
    timed by a clock that each step advances by `costs[precision]`: the choice, and the (precision,
    dtype of the output layer's matmuls) of every step that ran. On a CPU the probe's step, like
    training's, computes the loss in chunks (model.chunked_output_loss), told that dtype."""
    from transformer_mt import model as model_module
    from transformer_mt.config import TrainConfig

    now, runs, logits = [0.0], [], []
    chunked = model_module.chunked_output_loss
    monkeypatch.setattr(
        model_module,
        "chunked_output_loss",
        lambda h, w, y, eps, dtype: logits.append(dtype) or chunked(h, w, y, eps, dtype),
    )
    real_step = prepare.cpu_probe_step(model, TrainConfig(max_tokens=max_tokens), CPU)

    def step(precision: str) -> None:
        real_step(precision)
        runs.append((precision, logits[-1]))
        now[0] += costs[precision]

    real = runtime.fastest_cpu_precision
    monkeypatch.setattr(
        runtime, "fastest_cpu_precision", lambda s, **kw: real(s, clock=lambda: now[0], **kw)
    )
    return runtime.choose_cpu_precision(step), runs


@pytest.mark.parametrize(
    "costs, chosen",
    [
        ({"fp32": 1.0, "bf16-output": 0.8, "bf16": 0.95}, "bf16-output"),
        ({"fp32": 1.0, "bf16-output": 0.85, "bf16": 0.5}, "bf16"),
        ({"fp32": 1.0, "bf16-output": 0.95, "bf16": 0.92}, "fp32"),  # neither 10% faster
    ],
)
def test_the_probe_runs_a_real_training_step_in_each_precision(
    native_bf16, monkeypatch, costs, chosen
):
    """Each candidate is a real step in its precision (the output layer's matmuls in bf16 for
    bf16-output and bf16), a warm-up and two timed; the choice follows the timings; and the probe
    leaves the model as it found it."""
    from transformer_mt.config import ModelConfig
    from transformer_mt.model import Transformer

    model = Transformer(
        ModelConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, d_ff=32), 30, 30, True
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    choice, runs = probe_on_a_fake_clock(monkeypatch, model, 200, costs)
    assert choice == chosen
    dtypes = {"fp32": torch.float32, "bf16-output": torch.bfloat16, "bf16": torch.bfloat16}
    assert sorted(runs, key=lambda run: run[0]) == sorted(3 * list(dtypes.items()))
    assert model.output_dtype is None  # the trainer sets it for the chosen precision, not the probe
    # no gradient left behind for the first update
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])  # and no weight changed


def test_every_probe_step_takes_batch_shapes_no_earlier_step_took(monkeypatch):
    """Training's batches rarely repeat a shape, and oneDNN builds bf16 kernels for each new one:
    on a Xeon with AMX a probe repeating one shape found bf16 1.27x faster than fp32 while training
    ran it slower. So each step of the probe, whatever its precision, runs source and target
    lengths (of different sizes, as a pair's sides) that no earlier step ran, in batches of about
    the run's tokens."""
    from transformer_mt.config import ModelConfig, TrainConfig
    from transformer_mt.model import Transformer

    model = Transformer(
        ModelConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, d_ff=32), 30, 30, True
    )
    shapes, loss = [], prepare.training_loss
    monkeypatch.setattr(
        prepare,
        "training_loss",
        lambda forward, src, tgt_in, tgt_out, *a: (
            shapes.append((tuple(src.shape), tuple(tgt_in.shape)))
            or loss(forward, src, tgt_in, tgt_out, *a)
        ),
    )
    step = prepare.cpu_probe_step(model, TrainConfig(max_tokens=240), CPU)
    for precision in 3 * ["fp32", "bf16-output", "bf16"]:
        step(precision)
    src_shapes, tgt_shapes = zip(*shapes)
    assert len(set(src_shapes)) == len(set(tgt_shapes)) == 9
    assert all(s[1] != t[1] for s, t in shapes)  # the two sides' lengths differ
    assert all(240 - s[1] < s[0] * s[1] <= 240 for s in src_shapes)


def test_the_log_line_says_which_candidates_were_skipped_and_why(monkeypatch, caplog):
    """And on a CPU without native bf16 that nothing was timed: training in fp32 at once."""
    from transformer_mt.config import ModelConfig, TrainConfig
    from transformer_mt.model import Transformer

    monkeypatch.setattr(
        runtime,
        "fastest_cpu_precision",
        lambda step, **kw: (
            "fp32",
            {"fp32": 0.188, "bf16-output": 0.432},
            {"bf16": "its first step took 4534 ms, over 2x fp32's 190 ms"},
        ),
    )
    model = Transformer(
        ModelConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, d_ff=32), 30, 30, True
    )
    with caplog.at_level("INFO", logger="transformer_mt"):
        assert (
            runtime.choose_cpu_precision(prepare.cpu_probe_step(model, TrainConfig(), CPU))
            == "fp32"
        )
    assert (
        "188 ms in fp32, 432 ms in bf16-output on this CPU; bf16 skipped (its first step took "
        "4534 ms" in caplog.text
    )
    caplog.clear()
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx2", "fma"})
    # the real probe
    monkeypatch.setattr(runtime, "fastest_cpu_precision", fastest_cpu_precision)
    with caplog.at_level("INFO", logger="transformer_mt"):
        assert (
            runtime.choose_cpu_precision(prepare.cpu_probe_step(model, TrainConfig(), CPU))
            == "fp32"
        )
    assert (
        "precision auto: nothing timed; bf16-output skipped (no native bf16: the CPU has no "
        "avx512_bf16" in caplog.text
    )
    assert "training in fp32" in caplog.text


@pytest.mark.parametrize("src_vocab, tgt_vocab", [(30, 50), (50, 30)])
def test_the_probe_runs_with_separate_vocabularies_of_two_sizes(
    native_bf16, monkeypatch, src_vocab, tgt_vocab
):
    """Issue 22: with tokenizer.joint false the probe fed target ids as source ids: IndexError when
    the target vocabulary is the larger. Source ids must stay within the source vocabulary, target
    ids within the target's, in every candidate's step (native bf16, faked: all three run)."""
    from transformer_mt.config import ModelConfig
    from transformer_mt.model import Transformer

    model = Transformer(
        ModelConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, d_ff=32),
        src_vocab,
        tgt_vocab,
        False,
    )
    costs = {"fp32": 1.0, "bf16-output": 1.0, "bf16": 1.0}
    choice, runs = probe_on_a_fake_clock(monkeypatch, model, 96, costs)
    assert choice == "fp32" and sorted(p for p, _ in runs) == sorted(3 * list(costs))


def test_the_probe_hands_back_the_ms_a_step_that_its_log_line_gives(monkeypatch, caplog):
    seconds = {"fp32": 0.4, "bf16-output": 0.37, "bf16": 0.5}
    monkeypatch.setattr(
        runtime, "fastest_cpu_precision", lambda step, **kw: ("bf16-output", seconds, {})
    )
    timings: dict[str, float] = {}
    with caplog.at_level(logging.INFO, logger="transformer_mt"):
        # 0.37 is not 10% under 0.4: fp32 keeps the near-tie
        assert runtime.choose_cpu_precision(lambda p: None, timings=timings) == "fp32"
    assert timings == {"fp32": 400.0, "bf16-output": 370.0, "bf16": 500.0}
    assert "400 ms in fp32, 370 ms in bf16-output, 500 ms in bf16" in caplog.text


def test_ranks_train_in_the_most_exact_of_their_choices(monkeypatch):
    """Each rank's choice goes through `agree_min` as its index in CPU_PRECISIONS, most exact first
    (fp32, then fp32 with a bf16 output layer, then bf16): a rank that measured bf16 fastest trains
    in bf16-output when another rank chose that."""
    seconds = {"fp32": 1.0, "bf16": 0.5, "bf16-output": 0.8}
    monkeypatch.setattr(runtime, "fastest_cpu_precision", lambda step, **kw: ("bf16", seconds, {}))
    assert runtime.choose_cpu_precision(lambda precision: None) == "bf16"
    other = runtime.CPU_PRECISIONS.index("bf16-output")
    assert (
        runtime.choose_cpu_precision(lambda precision: None, lambda mine: min(mine, other))
        == "bf16-output"
    )


def test_auto_is_measured_on_a_cpu_and_a_resumed_run_keeps_its_precision():
    probes = []

    def probe() -> str:
        probes.append(1)
        return "bf16-output"

    assert runtime.training_precision("auto", CPU, "", probe) == "bf16-output"
    assert runtime.training_precision("auto", CPU, "fp32", probe) == "fp32"  # as it began
    assert runtime.training_precision("bf16", CPU, "fp32", probe) == "bf16"  # as asked
    assert probes == [1]


@pytest.mark.parametrize(
    "costs, chosen",
    [
        ({"fused": 0.0087, "math": 0.0052}, "math"),  # the AVX2-only EPYC's timings
        ({"fused": 0.0100, "math": 0.0095}, "fused"),  # math not 10% faster: torch's own choice
        ({"fused": 0.0050, "math": 0.0090}, "fused"),
        ({"fused": 0.0112, "math": 0.0013}, "math"),  # bf16 on a Xeon with AMX
    ],
)
def test_attention_auto_trains_with_math_only_where_clearly_faster(caplog, costs, chosen):
    steps = FakeSteps(costs)
    with caplog.at_level("INFO", logger="transformer_mt"):
        assert (
            runtime.choose_cpu_attention(steps, repeats=3, clock=steps.clock, precision="bf16")
            == chosen
        )
    # one warm-up and three timed each, taken in turns
    assert steps.calls == 4 * ["fused", "math"]
    assert f"{1000 * costs['math']:.2f} ms math" in caplog.text
    assert "in bf16 took" in caplog.text and f"for bf16: {chosen}" in caplog.text


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_probe_times_the_kernel_it_is_given(monkeypatch, precision):
    """cpu_attention_probe's step runs attention forward and backward with the named kernel (the
    backward recorded for the output is the flash kernel's or the composite's), in the run's
    precision, without touching the model or the run's random stream."""
    from transformer_mt.config import ModelConfig, TrainConfig
    from transformer_mt.model import Transformer

    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []

    def recorded(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        seen.append((out.grad_fn.name(), out.dtype))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    model = Transformer(
        ModelConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, d_ff=32), 30, 30, True
    )
    step = prepare.cpu_attention_probe(model, TrainConfig(max_tokens=200), CPU, precision)
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    for kernel in ("fused", "math"):
        seen.clear()
        step(kernel)
        assert len(seen) == 2  # the padding-masked self-attention and the causal one
        assert all(("FlashAttention" in name) == (kernel == "fused") for name, _ in seen)
        assert {dtype for _, dtype in seen} == {runtime.compute_dtype(precision)}
    torch.testing.assert_close(torch.rand(3), expected_next)
    assert all(p.grad is None for p in model.parameters())


def test_the_math_kernel_computes_what_the_fused_one_does():
    """Both kernels compute softmax(QK^T / sqrt(d_k) + mask) V and its gradients (Eq. 1): equal to
    fp32 rounding, with a padding mask and with the causal one."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 2, 7, 8).unbind(0)  # (B, H, T, d_k) each
    grad = torch.randn(4, 2, 7, 8)
    pad = (torch.arange(7) < torch.tensor([7, 5, 3, 1])[:, None])[:, None, None, :]  # (B, 1, 1, T)
    for masks in ({"attn_mask": pad}, {"is_causal": True}):
        results = []
        for kernel in runtime.ATTENTION_KERNELS:
            q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k, v))
            with runtime.attention_kernel(kernel):
                out = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, **masks)
            out.backward(grad)
            results.append((out, q_.grad, k_.grad, v_.grad))
        for fused, math_ in zip(*results):
            torch.testing.assert_close(math_, fused)


def test_the_math_kernel_keeps_bf16_attention_in_bf16_and_restores_the_flag():
    """attention_kernel("math") without SDPA's default fp32 upcast (runtime.math_attention): on bf16
    inputs its forward and backward cast no tensor, where the default math kernel casts them
    (the count this test would catch coming back); it computes Eq. 1 to bf16's rounding; and the
    process-wide flag is as it was before."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 2, 7, 8).unbind(0)  # (B, H, T, d_k) each
    grad = torch.randn(4, 2, 7, 8)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fp32

    def run(context):
        q_, k_, v_ = (x.bfloat16().requires_grad_() for x in (q, k, v))
        grad_ = grad.bfloat16()
        with torch.profiler.profile(record_shapes=True) as prof:
            with context:
                out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
            out.backward(grad_)
        casts = prof.key_averages(group_by_input_shape=True)  # of tensors, not of the scale
        copies = sum(e.count for e in casts if e.key == "aten::_to_copy" and e.input_shapes[0])
        return out, q_.grad, copies

    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    out, q_grad, copies = run(runtime.attention_kernel("math"))
    assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed() == before
    assert copies == 0 and out.dtype == q_grad.dtype == torch.bfloat16
    assert run(sdpa_kernel(SDPBackend.MATH))[2] > 0  # the default upcasts
    torch.testing.assert_close(out.float(), reference, atol=0.02, rtol=0.02)


def test_attention_is_timed_only_for_auto_on_a_cpu_and_a_resumed_run_keeps_its_kernel(
    monkeypatch,
):
    from transformer_mt.config import ModelConfig, TrainConfig
    from transformer_mt.model import Transformer

    model = Transformer(
        ModelConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, d_ff=32), 30, 30, True
    )
    probes = []
    monkeypatch.setattr(
        prepare, "choose_cpu_attention", lambda step, **kw: probes.append(1) or "math"
    )

    def kernel(attention: str, device: torch.device = CPU, resumed: str = "") -> str:
        checkpoint = {"train_state": {"attention": resumed}} if resumed else None
        return prepare.set_up_attention(
            model, TrainConfig(attention=attention), device, "fp32", checkpoint
        )

    assert kernel("auto") == "math" and probes == [1]
    assert kernel("auto", resumed="fused") == "fused"  # as the run began
    assert kernel("fused") == "fused" and kernel("math", resumed="fused") == "math"  # as asked
    assert kernel("auto", torch.device("cuda")) == "fused"  # a GPU: torch's fused kernels
    assert probes == [1]


def test_the_precision_probe_times_each_precision_with_its_own_attention_kernel(monkeypatch):
    """precision auto times a bf16 step with the kernel a bf16 run would train with, not fp32's: on
    a Xeon with AMX torch's flash kernel took ~4x math's time in bf16, and made bf16 the slowest
    precision. Each precision's kernel is measured once, however many steps the probe takes."""
    from transformer_mt.config import ModelConfig, TrainConfig
    from transformer_mt.model import Transformer

    model = Transformer(
        ModelConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, d_ff=32), 30, 30, True
    )
    # the attention probe's "step" is its precision; its choice: math for bf16 alone
    monkeypatch.setattr(prepare, "cpu_attention_probe", lambda m, tc, device, precision: precision)
    measured = []
    monkeypatch.setattr(
        prepare,
        "choose_cpu_attention",
        lambda precision_, **kw: (
            measured.append(precision_) or ("math" if precision_ == "bf16" else "fused")
        ),
    )
    sdpa, backward = F.scaled_dot_product_attention, []

    def recorded(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        backward.append("fused" if "FlashAttention" in out.grad_fn.name() else "math")
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    tc = TrainConfig(attention="auto", max_tokens=48)
    kernel_for = prepare.attention_chooser(model, tc, CPU)
    step = prepare.cpu_probe_step(model, tc, CPU, kernel_for)
    for precision in ("fp32", "bf16", "fp32", "bf16"):
        backward.clear()
        step(precision)
        assert set(backward) == {"math" if precision == "bf16" else "fused"}, precision
    assert measured == ["fp32", "bf16"]
    assert kernel_for("bf16") == "math" and measured == ["fp32", "bf16"]
    # a kernel asked for in the config is every precision's
    fixed = prepare.attention_chooser(model, TrainConfig(attention="fused"), CPU)
    assert fixed("bf16") == "fused" and measured == ["fp32", "bf16"]


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc are Linux's"
)
def test_malloc_keeps_freed_memory_so_big_tensors_stop_faulting():
    """64 MB tensors allocated and freed thirty times: glibc mmaps and unmaps each (16,000 fresh
    pages a time) unless keep_freed_memory() told it to keep them; then, once the heap has grown to
    its working size, they reuse its pages. Run in fresh processes: mallopt is process-wide."""
    script = textwrap.dedent("""
        import sys, torch
        from transformer_mt.runtime import keep_freed_memory, minor_faults
        if sys.argv[1] == "keep":
            assert keep_freed_memory()
        # the first allocations fault either way (the heap grows to its working size)
        for _ in range(10):
            torch.ones(16 * 1024 * 1024).sum()
        before = minor_faults()
        for _ in range(30):
            torch.ones(16 * 1024 * 1024).sum()  # 64 MB, freed at once
        print(minor_faults() - before)
        """)
    faults = {
        mode: int(
            subprocess.run(
                [sys.executable, "-c", script, mode], capture_output=True, text=True, check=True
            ).stdout
        )
        for mode in ("default", "keep")
    }
    assert faults["default"] > 30 * 16000 * 0.9  # every 64 MB block came back as fresh pages
    assert faults["keep"] < faults["default"] / 6, faults  # at most a few more growths of the heap
    assert minor_faults() > 0


def test_the_onednn_kernel_cache_is_raised_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv(runtime.ONEDNN_CACHE, raising=False)
    assert runtime.keep_onednn_kernels()
    assert int(os.environ[runtime.ONEDNN_CACHE]) > 1024  # oneDNN's own default
    monkeypatch.setenv(runtime.ONEDNN_CACHE, "7")
    assert not runtime.keep_onednn_kernels() and os.environ[runtime.ONEDNN_CACHE] == "7"


def test_onednn_takes_the_cache_size_set_after_torch_is_imported():
    """keep_onednn_kernels runs inside tmt train, after `import torch`: oneDNN must still read it.
    With a capacity of 0 (no cache) the same bf16 matrix product compiles its kernel every time;
    with the default the second and third find it (ONEDNN_VERBOSE=2 logs each lookup)."""
    script = textwrap.dedent("""
        import sys, torch
        from transformer_mt.runtime import keep_onednn_kernels
        torch.set_num_threads(1)
        if sys.argv[1] == "none":
            assert keep_onednn_kernels(capacity=0)
        a = torch.ones(64, 64, dtype=torch.bfloat16)
        for _ in range(3):
            torch.matmul(a, a)
        """)
    env = {k: v for k, v in os.environ.items() if k != runtime.ONEDNN_CACHE}
    lookups = {}
    for mode in ("default", "none"):
        log = subprocess.run(
            [sys.executable, "-c", script, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # oneDNN's verbose lines go to stdout
            text=True,
            check=True,
            env={**env, "ONEDNN_VERBOSE": "2"},
        ).stdout
        lookups[mode] = {w: log.count(w) for w in ("cache_hit", "cache_miss")}
    if not sum(lookups["default"].values()):
        pytest.skip("torch runs bf16 matrix products without oneDNN on this CPU: no cache to size")
    assert lookups["default"]["cache_hit"] >= 2, lookups
    assert lookups["none"]["cache_hit"] == 0 and lookups["none"]["cache_miss"] >= 3, lookups


def test_a_folder_renamed_into_place_has_a_plain_mkdirs_permissions(tmp_path):
    """Exports and token-cache entries are filled in a temporary folder, then renamed: mkdtemp's
    0700 made them unreadable to any other user (a service account serving an export); they get what
    mkdir gives."""
    import os

    from transformer_mt.fileio import temp_dir

    umask = os.umask(0o022)
    try:
        (tmp_path / "plain").mkdir()
        made = temp_dir(tmp_path, prefix="x.")
    finally:
        os.umask(umask)
    assert made.parent == tmp_path and made.name.startswith("x.")
    assert made.stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777 == 0o755


def test_a_stop_signal_during_a_write_to_the_same_stream_still_stops_the_run(monkeypatch, capfd):
    """A signal that lands while the main thread writes the log (a member's train.log) makes
    tqdm.write raise "reentrant call"; the handler must still record the stop and say so."""

    def reentrant(*args, **kwargs):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='train.log'>")

    monkeypatch.setattr(runtime.tqdm, "write", reentrant)
    stop = runtime.StopSignals()
    stop.handler(15, None)  # SIGTERM
    assert stop.caught == "SIGTERM"
    assert "tmt: SIGTERM: finishing this step and writing last.pt" in capfd.readouterr().err


def test_set_threads_calls_torch_only_for_a_new_count(monkeypatch):
    """An explicit torch.set_num_threads with the count torch already runs slowed its flash
    attention kernel on an AVX2-only EPYC, so set_threads skips that call and makes any other."""
    calls = []
    monkeypatch.setattr(runtime.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(runtime.torch, "set_num_threads", calls.append)
    runtime.set_threads(2)
    assert calls == []
    runtime.set_threads(1)
    assert calls == [1]

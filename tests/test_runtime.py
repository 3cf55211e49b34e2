"""Issue 16's CPU levers: precision `auto` measured at start-up, and malloc keeping freed memory."""

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from transformer_mt import train as train_module
from transformer_mt.runtime import fastest_cpu_precision, minor_faults


def _sleeper(costs: dict[str, float]):
    calls = []

    def step(precision: str) -> None:
        calls.append(precision)
        torch.rand(100)  # a step draws random numbers (dropout)
        time.sleep(costs[precision])
    return step, calls


@pytest.mark.parametrize("costs, faster", [({"fp32": 0.03, "bf16": 0.001}, "bf16"),
                                           ({"fp32": 0.001, "bf16": 0.03}, "fp32")])
def test_the_faster_precision_wins_and_the_random_stream_is_untouched(costs, faster):
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    step, calls = _sleeper(costs)
    choice, seconds = fastest_cpu_precision(step, repeats=2)
    assert choice == faster and set(seconds) == {"fp32", "bf16"}
    assert seconds[faster] < seconds["fp32" if faster == "bf16" else "bf16"]
    assert calls.count("fp32") == calls.count("bf16") == 3  # one warm-up and two timed each
    torch.testing.assert_close(torch.rand(3), expected_next)  # the probe's draws did not shift the run's


@pytest.mark.parametrize("bf16_seconds, output_seconds, chosen", [
    (0.5, 0.8, "bf16"), (0.95, 0.97, "fp32"), (1.2, 1.1, "fp32"), (1.2, 0.8, "bf16-output"), (0.85, 0.7, "bf16-output")])
def test_auto_takes_a_bf16_precision_only_when_clearly_faster(monkeypatch, caplog, bf16_seconds, output_seconds, chosen):
    """The fastest of fp32, bf16 and bf16-output (fp32 with a bf16 output layer), but fp32 unless 10% slower."""
    from transformer_mt.config import ModelConfig, TrainConfig
    from transformer_mt.distributed import Dist
    from transformer_mt.model import Transformer

    seconds = {"fp32": 1.0, "bf16": bf16_seconds, "bf16-output": output_seconds}
    monkeypatch.setattr(train_module, "fastest_cpu_precision",
                        lambda step, **kw: (min(seconds, key=seconds.get), seconds))
    model = Transformer(ModelConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, d_ff=32), 30, 30, True)
    with caplog.at_level("INFO", logger="transformer_mt"):
        assert train_module.choose_cpu_precision(model, TrainConfig(), Dist(), torch.device("cpu")) == chosen
    assert f"training in {chosen}" in caplog.text and "1000 ms in fp32" in caplog.text


def test_the_probe_runs_a_real_training_step_in_each_precision():
    from transformer_mt.config import ModelConfig, TrainConfig
    from transformer_mt.distributed import Dist
    from transformer_mt.model import Transformer

    model = Transformer(ModelConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, d_ff=32), 30, 30, True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert train_module.choose_cpu_precision(model, TrainConfig(max_tokens=200), Dist(), torch.device("cpu")) in (
        "fp32", "bf16", "bf16-output")
    assert model.output_dtype is None  # the trainer sets it for the chosen precision, not the probe
    assert all(p.grad is None for p in model.parameters())  # no gradient left behind for the first update
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])  # and no weight changed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc are Linux's")
def test_malloc_keeps_freed_memory_so_big_tensors_stop_faulting():
    """64 MB tensors allocated and freed thirty times: glibc mmaps and unmaps each (16,000 fresh pages a time)
    unless keep_freed_memory() told it to keep them; then, once the heap has grown to its working size,
    they reuse its pages. Run in fresh processes: mallopt is process-wide."""
    script = textwrap.dedent("""
        import sys, torch
        from transformer_mt.runtime import keep_freed_memory, minor_faults
        if sys.argv[1] == "keep":
            assert keep_freed_memory()
        for _ in range(10):  # the first allocations fault either way (the heap grows to its working size)
            torch.ones(16 * 1024 * 1024).sum()
        before = minor_faults()
        for _ in range(30):
            torch.ones(16 * 1024 * 1024).sum()  # 64 MB, freed at once
        print(minor_faults() - before)
        """)
    faults = {mode: int(subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ("default", "keep")}
    assert faults["default"] > 30 * 16000 * 0.9  # every 64 MB block came back as fresh pages
    assert faults["keep"] < faults["default"] / 6, faults  # at most a few more growths of the heap
    assert minor_faults() > 0

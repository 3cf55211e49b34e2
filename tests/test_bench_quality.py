"""The benchmark scripts' own logic: the checkpoints bench_quality.py keeps on the way, and
sentences the reports compute from their figures."""

import time
from pathlib import Path

from scripts import bench, bench_quality


def write_step(run_dir: Path, step: int) -> None:
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints" / f"step_{step}.pt").write_text(f"weights of step {step}")


def test_each_mark_keeps_the_newest_step_checkpoint_once(tmp_path):
    snaps = bench_quality.Snapshots(tmp_path, (40.0, 20.0))
    snaps.take(21.0)  # nothing saved yet: the mark stays open
    assert snaps.taken == {}
    write_step(tmp_path, 250)
    write_step(tmp_path, 1000)  # newest by step number, not by name
    write_step(tmp_path, 500)
    snaps.take(21.0)
    assert (tmp_path / "checkpoints" / "at_20min.pt").read_text() == "weights of step 1000"
    assert list(snaps.taken) == [20.0]
    write_step(tmp_path, 1250)
    snaps.take(39.0)  # 20 is taken already, 40 has not passed
    assert (tmp_path / "checkpoints" / "at_20min.pt").read_text() == "weights of step 1000"
    assert not (tmp_path / "checkpoints" / "at_40min.pt").exists()
    snaps.take(40.5)
    assert (tmp_path / "checkpoints" / "at_40min.pt").read_text() == "weights of step 1250"
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    # no temp file left behind
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "at_20min.pt",
        "at_40min.pt",
        "step_1000.pt",
        "step_1250.pt",
        "step_250.pt",
        "step_500.pt",
    ]


def test_the_watcher_thread_takes_a_mark_while_the_run_trains(tmp_path):
    write_step(tmp_path, 100)
    with bench_quality.Snapshots(tmp_path, (0.0,), poll_seconds=0.01) as snaps:
        for _ in range(500):
            if snaps.taken:
                break
            time.sleep(0.01)
    assert (tmp_path / "checkpoints" / "at_0min.pt").read_text() == "weights of step 100"


def test_the_report_gives_test_bleu_at_each_mark_and_at_the_end():
    recipe = {
        "beam": 5,
        "bleu": 41.0,
        "tokenized_bleu": 41.6,
        "chrf": 65.0,
        "ter": 44.0,
        "train_minutes": 58.0,
        "steps": 10000,
        "step": 10000,
        "epochs": 41,
        "tgt_tok_per_s": 5600,
        "sentences_per_second": 110,
        "evaluated": "best.pt",
        "bleu_signature": "s",
        "chrf_signature": "c",
        "ter_signature": "t",
        "tokenized_bleu_description": "d",
        "test_bleu_by_minute": {
            "20": {"step": 3100, "bleu": 30.5, "tokenized_bleu": 31.25},
            "40": {"step": 6600, "bleu": 37.0, "tokenized_bleu": 37.5},
        },
    }
    text = "\n\n".join(
        bench_quality.report(
            {"recipe": recipe, "recipe_config": "c.yaml", "date": "2026-11-23", "cpu": "X"}
        )
    )
    assert (
        "20 min (step 3,100): 30.50 / 31.25; 40 min (step 6,600): 37.00 / 37.50; the end "
        "(best.pt, step 10,000): 41.00 / 41.60."
    ) in text


def test_a_run_says_what_the_precision_probe_timed_when_its_checkpoint_kept_it():
    run = {"trained_precision": "fp32", "precision_probe_ms": {"fp32": 361.4, "bf16": 1486.0}}
    assert bench_quality.probe_text(run) == (
        " (precision auto's start-up probe, a step: 361 ms in fp32, 1,486 ms in bf16)"
    )
    assert bench_quality.probe_text({**run, "precision_probe_ms": {}}) == ""
    assert bench_quality.probe_text({"trained_precision": "fp32"}) == ""  # older rows


def test_a_run_with_avx2_kernels_says_whether_the_cpu_is_avx2_only_itself():
    run = {
        "beam": 5,
        "bleu": 38.6,
        "chrf": 62.6,
        "ter": 46.9,
        "train_minutes": 57.9,
        "steps": 5660,
        "step": 5660,
        "epochs": 24,
        "tgt_tok_per_s": 3135,
        "sentences_per_second": 80,
        "evaluated": "best.pt",
        "bleu_signature": "s",
        "chrf_signature": "c",
        "ter_signature": "t",
        "avx2": True,
    }

    def where(flags):
        res = {"recipe_avx2": {**run, "cpu_flags": flags}, "date": "x", "cpu": "X"}
        return "\n\n".join(bench_quality.report(res))

    own = "no AVX-512 on this CPU: its own kernels, an AVX2-only CPU itself"
    assert own in where(["avx2", "fma"])  # the AMD EPYC of issue 25
    approximated = where(["avx2", "fma", "avx512f", "avx512_bf16"])
    assert "with AVX2 kernels only (ATEN_CPU_CAPABILITY=avx2" in approximated
    assert own not in approximated


def test_the_ceiling_sentence_is_computed_from_the_run_and_names_what_runs_bf16():
    amd = bench.ceiling_sentence(
        {"matmul_gflops": {"fp32": 124.0, "bf16": 360.0}, "cpu_bf16": "AVX512-BF16"}
    )
    assert "AVX512-BF16, no AMX" in amd and "2.9× the fp32 one" in amd  # 360 / 124 = 2.90
    intel = bench.ceiling_sentence(
        {"matmul_gflops": {"fp32": 279.0, "bf16": 2271.0}, "cpu_bf16": "AMX"}
    )
    assert "AMX tiles" in intel and "8.1× the fp32 one" in intel  # 2271 / 279 = 8.14
    assert "not recorded" in bench.ceiling_sentence({"matmul_gflops": {"fp32": 1.0, "bf16": 1.0}})
    # the AVX2-only AMD EPYC: bf16 emulated, ~55x below fp32, so no MFU against it
    avx2 = bench.ceiling_sentence(
        {
            "matmul_gflops": {"fp32": 93.6, "bf16": 1.7},
            "cpu_bf16": "none",
            "bf16_obstacle": "no avx512_bf16 flag",
        }
    )
    assert "bf16 is emulated (no avx512_bf16 flag)" in avx2 and "0.02× the fp32 one" in avx2
    assert "against the fp32 ceiling only" in avx2


def test_a_result_without_tokenized_bleu_reports_sacrebleu_alone():
    assert bench_quality.both_bleus({"bleu": 30.5}) == "30.50"
    assert bench_quality.both_bleus({"bleu": 30.5, "tokenized_bleu": 31.0}) == "30.50 / 31.00"


def test_an_ensemble_run_keeps_every_members_checkpoint_at_a_mark(tmp_path):
    members = [tmp_path / "members" / str(i) for i in (1, 2)]
    for m in members:  # as `tmt train` makes them before the members start
        m.mkdir(parents=True)
    snaps = bench_quality.Snapshots(tmp_path, (20.0,))
    write_step(members[0], 500)
    snaps.take(21.0)  # member 2 has nothing yet: the mark waits for both
    assert snaps.taken == {}
    write_step(members[1], 400)
    write_step(members[1], 450)
    snaps.take(21.0)
    assert [(m / "checkpoints" / "at_20min.pt").read_text() for m in members] == [
        "weights of step 500",
        "weights of step 450",
    ]


def test_the_report_gives_an_ensembles_member_steps():
    recipe = {
        "beam": 5,
        "bleu": 42.0,
        "tokenized_bleu": 42.5,
        "chrf": 65.0,
        "ter": 44.0,
        "train_minutes": 59.0,
        "steps": 22000,
        "step": 11000,
        "epochs": 45,
        "tgt_tok_per_s": 12000,
        "sentences_per_second": 60,
        "evaluated": "1/best.pt + 2/best.pt",
        "bleu_signature": "s",
        "chrf_signature": "c",
        "ter_signature": "t",
        "tokenized_bleu_description": "d",
        "ensemble": 2,
        "member_steps": [11000, 10990],
        "ensemble_valid_bleu": 42.25,
        "test_bleu_by_minute": {"20": {"step": [3100, 3050], "bleu": 30.5}},
    }
    text = "\n\n".join(
        bench_quality.report(
            {"recipe": recipe, "recipe_config": "c.yaml", "date": "2026-11-26", "cpu": "X"}
        )
    )
    assert "An ensemble of 2 models trained side by side" in text
    assert "11,000 and 10,990 updates" in text and "42.25 for the ensemble" in text
    assert (
        "20 min (steps 3,100 and 3,050): 30.50; the end (1/best.pt + 2/best.pt, steps 11,000 and "
        "10,990): 42.00 / 42.50."
    ) in text


def test_a_recipe_row_names_the_settings_its_config_has_changed_since(tmp_path):
    config = tmp_path / "c.yaml"  # today's recipe: sampling on, 10,000 pieces
    config.write_text(
        "data: {train: t, valid: v, subword_sampling: {nbest: 16, alpha: 0.5}}\n"
        "tokenizer: {vocab_size: 10000}\n"
    )
    run = {
        "beam": 5,
        "bleu": 41.0,
        "chrf": 65.0,
        "ter": 44.0,
        "train_minutes": 58.0,
        "steps": 10000,
        "step": 10000,
        "epochs": 41,
        "tgt_tok_per_s": 5600,
        "sentences_per_second": 110,
        "evaluated": "best.pt",
        "bleu_signature": "s",
        "chrf_signature": "c",
        "ter_signature": "t",
        "config": str(config),
    }
    entry = {"data.subword_sampling": "off", "tokenizer.vocab_size": 10000, "model.dropout": 0.3}
    res = {"history": [{"date": "2026-11-27 11:01", **entry}], "date": "x", "cpu": "X"}

    def sentence(**changes):
        text = "\n\n".join(bench_quality.report({**res, "recipe": {**run, **changes}}))
        return [b for b in text.split("\n\n") if b.startswith("This run predates")]

    # the dropout differs too, but the recipe run had set it itself
    assert sentence(date="2026-11-27 11:01", changes="model.dropout=0.3") == [
        "This run predates the config's present settings; it ran with "
        "`data.subword_sampling` off (now 16-best, α 0.5)."
    ]
    # a change to norm_type does not hide the norm it shares a prefix with
    res["history"][0]["model.norm"] = "pre"
    assert sentence(date="2026-11-27 11:01", changes="model.norm_type=scale model.dropout=0.3") == [
        "This run predates the config's present settings; it ran with "
        "`data.subword_sampling` off (now 16-best, α 0.5), `model.norm` pre (now post)."
    ]
    assert sentence(date="2026-11-27 12:00") == []  # no history entry: nothing to compare


def test_the_history_table_prints_every_score_with_two_decimals(tmp_path):
    # sacreBLEU prints 39.80 where the JSON keeps the float 39.8; a column mixing 39.8 and 40.17
    # reads as if the two were measured to different precisions
    history = tmp_path / "history.md"
    history.write_text("<!-- experiments:start -->\n<!-- experiments:end -->\n")
    entry = {"date": "2026-12-02 00:46", "bleu": 39.8, "tokenized_bleu": 40.3, "chrf": 64.03}
    bench_quality.write_history(
        {"history": [{**entry, "steps": 5781, "train_minutes": 58.4}]}, history
    )
    row = history.read_text().splitlines()[-2]
    assert "| 39.80 | 40.30 | 64.03 |" in row
    assert "| 5781 | 58.4 |" in row  # counts and minutes are not scores: as they are


def test_the_history_table_shows_both_stacks_depths():
    # a run that moves a layer from the decoder to the encoder must read so in the table's
    # recipe columns, not only in its `changes` cell
    cfg = {
        "data": {},
        "model": {"encoder_layers": 5, "decoder_layers": 3},
        "tokenizer": {},
        "train": {},
        "decode": {},
    }
    settings = bench_quality.recipe_settings(cfg)
    assert (settings["model.encoder_layers"], settings["model.decoder_layers"]) == (5, 3)

"""Every benchmark entry point, end to end on a tiny model for a few steps: each runs its real code
path (children, servers, subprocesses included) with options that make it small, writes its JSON
and its section of a BENCHMARKS.md in a temporary folder, and the test reads both back. Nothing
here needs ../shared: the corpus is the built-in demo grammar's, and the peers are skipped as the
benches skip them without the kit (what the benches read from ../shared where it is there, such as
Multi30k's sentences for the soak, they read here too)."""

import json
import shlex
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scripts import (
    bench,
    bench_allocator,
    bench_bigcorpus,
    bench_decode,
    bench_demo,
    bench_finetune,
    bench_quality,
    bench_serve,
    ct2_agreement,
    soak_serve,
    sweep,
)
from transformer_mt.config import load_config
from transformer_mt.demo_corpus import write_corpus
from transformer_mt.runtime import ATTENTION_KERNELS
from transformer_mt.train import train

pytestmark = pytest.mark.slow

# The tiny model every bench trains or loads: sizes as --set overrides (the benches that take a
# config of their own get these).
TINY = [
    "tokenizer.vocab_size=80",
    "model.d_model=32",
    "model.heads=2",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "model.d_ff=64",
    "train.max_tokens=400",
    "train.threads=1",
]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Every process a bench starts computes on one thread: on a shared 2-core machine, two
    spinning threads per process made decoding 16 times slower."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny demo corpus, a config for it, and a run trained 3 steps on it (once a session)."""
    root = tmp_path_factory.mktemp("bench-smoke")
    data = root / "data"
    write_corpus(data, 400, 16, 16, seed=3)
    config = root / "tiny.yaml"
    config.write_text(
        textwrap.dedent(f"""\
        data: {{train: {data}/train, valid: {data}/valid, test: {data}/test, max_len: 64}}
        tokenizer: {{vocab_size: 80}}
        model: {{d_model: 32, heads: 2, encoder_layers: 1, decoder_layers: 1, d_ff: 64,
                 max_positions: 256}}
        train: {{max_steps: 3, max_tokens: 400, warmup: 2, valid_every: 3, threads: 1,
                 valid_bleu: false, device: cpu, precision: fp32}}
        decode: {{beam: 2}}
        output_dir: {root / "run"}
        """)
    )
    threads = torch.get_num_threads()
    train(load_config(config))  # sets torch's threads to the config's 1, for the whole process
    torch.set_num_threads(threads)
    return SimpleNamespace(root=root, data=data, config=config, run=root / "run")


def written(tmp_path: Path, name: str) -> tuple[dict, str]:
    """The JSON a bench wrote and the BENCHMARKS.md it wrote its section into."""
    out = tmp_path / "BENCHMARKS.md"
    return json.loads((tmp_path / name).read_text()), out.read_text()


def section(text: str, name: str) -> str:
    """One section of a BENCHMARKS.md, between its markers (fails when it is not there)."""
    start, end = f"<!-- {name}:start -->\n", f"\n<!-- {name}:end -->"
    assert start in text and end in text, text[:2000]
    return text.split(start, 1)[1].split(end, 1)[0]


def outputs(tmp_path: Path, name: str) -> list[str]:
    return ["--json", str(tmp_path / name), "--out", str(tmp_path / "BENCHMARKS.md")]


# The CPUs test_speed stands in for: the bench reads their flags through these two functions.
AVX512_BF16 = {"avx2", "fma", "avx512f", "avx512_bf16"}
AVX2_ONLY_CPU = {"avx2", "fma"}


@pytest.mark.parametrize("flags", [AVX512_BF16, AVX2_ONLY_CPU], ids=["avx512-bf16", "avx2-only"])
def test_speed(tiny, tmp_path, monkeypatch, flags):
    bf16 = "avx512_bf16" in flags
    monkeypatch.setattr(bench, "cpu_flags", lambda: flags)
    monkeypatch.setattr(bench, "cpu_bf16_obstacle", lambda: "" if bf16 else "no avx512_bf16 flag")
    data = [f"data.{s}={tiny.data}/{s}" for s in ("train", "valid", "test")]
    sets = [a for o in [*data, *TINY, f"output_dir={tmp_path / 'run'}"] for a in ("--set", o)]
    small = ["--rounds", "1", "--steps", "10", "--warmup", "1", "--no-peers", "--avx2"]
    small += [
        "--matmul-seconds",
        "0.01",
        "--batch-sizes",
        "200",
        "400",
        "--decode-lengths",
        "2",
        "4",
    ]
    assert bench.main([*small, *sets, *outputs(tmp_path, "bench.json")]) == 0
    res, md = written(tmp_path, "bench.json")
    if bf16:
        contenders = ["ours_fp32", "ours_bf16", "ours_bf16-output", "reference_fp32"]
        contenders += ["reference_bf16", "ours_bf16_without_fast_dropout"]
    else:  # bf16 emulated: no toolkit would train in it, so it is not timed
        contenders = ["ours_fp32", "reference_fp32", "ours_fp32_without_fast_dropout"]
    assert list(res["training"]) == contenders
    assert all(len(v["windows"]) == 1 and v["tok_s"] > 0 for v in res["training"].values())
    assert "ours_fp32/reference_fp32" in res["window_ratios"]
    assert [r["max_tokens"] for r in res["batch_scaling"]] == [200, 400]
    assert [r["length"] for r in res["decode_scaling"]] == [2, 4]
    assert res["model"]["d_model"] == 32 and 0 <= res["padding"]["tgt"] < 1
    text = section(md, "speed")
    scaling = f"### Tokens/s against batch size (ours, {'bf16' if bf16 else 'fp32'})"
    for heading in ("## Speed", "### Training throughput", scaling):
        assert f"\n{heading}" in f"\n{text}"
    assert all(f"| {name} |" in text for name in contenders)
    assert "fairseq not measured" in text
    assert ("| MFU vs bf16 ceiling |" in text) == bf16  # no MFU against an emulated ceiling
    # the attention kernel each of ours trained with, resolved as `tmt train` resolves auto
    precisions = ["fp32", "bf16", "bf16-output"] if bf16 else ["fp32"]
    assert list(res["attention"]) == precisions
    assert set(res["attention"].values()) <= set(ATTENTION_KERNELS)
    assert f"resolved as `tmt train` does): {res['attention']['fp32']} in fp32" in text
    if not bf16:  # no AVX-512: the native rows are the AVX2 ones, and no child measures them again
        assert "avx2" not in res and res["avx2_native"] == "the CPU has no AVX-512"
        assert "Not measured again in a child process: the CPU has no AVX-512" in text
        return
    # --avx2: the fp32 rows again in a child that torch dispatched below AVX-512
    avx2 = res["avx2"]
    assert list(avx2["training"]) == ["ours_fp32", "reference_fp32"]
    assert list(avx2["attention"]) == ["fp32"]
    assert not avx2["kernels"].startswith("AVX512") and avx2["bf16_obstacle"]
    assert "#### The same, with AVX2 kernels only" in text


def test_a_process_already_on_avx2_kernels_needs_no_avx2_child(monkeypatch):
    for k in bench.AVX2_ONLY:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(bench, "cpu_flags", lambda: AVX512_BF16)
    assert bench.native_avx2_only() == ""
    for k, v in bench.AVX2_ONLY.items():  # as make bench's own AVX2 rows set them
        monkeypatch.setenv(k, v.lower())
    assert bench.native_avx2_only() == "the AVX2-only variables are set"
    monkeypatch.setattr(bench, "cpu_flags", lambda: AVX2_ONLY_CPU)
    assert bench.native_avx2_only() == "the CPU has no AVX-512"


def test_training_only_without_its_own_json_is_refused_before_bench_json_is_touched(capsys):
    # --training-only writes a partial result: to the default bench.json it would lose the rest
    with pytest.raises(SystemExit):
        bench.parse_args(["--training-only"])
    assert "give it its own --json" in capsys.readouterr().err
    assert bench.parse_args([]).json.endswith("bench.json")


def test_decoding_engines(tiny, tmp_path):
    names = ["transformer-mt fp32", "ctranslate2 int8"]
    argv = ["--checkpoint", str(tiny.run / "checkpoints" / "best.pt")]
    argv += ["--src", f"{tiny.data}/test.en", "--ref", f"{tiny.data}/test.de", "--rounds", "1"]
    argv += ["--batch", "8", "--threads", "1", "--workdir", str(tmp_path / "ct2")]
    argv += [a for n in names for a in ("--only", n)]
    assert bench_decode.main([*argv, "--json", str(tmp_path / "decode.json")]) == 0
    rows = json.loads((tmp_path / "decode.json").read_text())["decoding"]
    assert list(rows) == names
    assert [rows[n]["engine"] for n in names] == ["torch", "ctranslate2"]
    for row in rows.values():
        assert row["sent_s"] > 0 and row["runs"] == [row["sent_s"]] and row["rss_of"] == "self"
        assert 0 <= row["bleu"] <= 100 and row["peak_rss_mb"] > 0


def test_quality(tiny, tmp_path, monkeypatch):
    """The recipe (trained in bf16, so that the fp32 comparison runs), the budget race without
    the peers, and the fp32 check, on the tiny config; the history goes to a file of its own."""
    # as in a checkout without the peers kit
    monkeypatch.setattr(bench_quality, "peers_ready", lambda: False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        tiny.config.read_text()
        .replace(f"output_dir: {tiny.run}", f"output_dir: {tmp_path / 'recipe'}")
        .replace("valid_bleu: false", "valid_bleu: true")
        .replace("precision: fp32", "precision: bf16")
        .replace("max_steps: 3", "max_steps: 2")
        .replace("valid_every: 3", "valid_every: 1")
    )
    sets = [a for o in [*TINY, "train.max_steps=2"] for a in ("--set", o)]
    argv = ["--recipe", str(recipe), "--test", f"{tiny.data}/test", "--runs", str(tmp_path)]
    argv += ["--budget", "1", "--fp32-steps", "2", "--history", str(tmp_path / "history.md")]
    assert bench_quality.main([*argv, *sets, *outputs(tmp_path, "quality.json")]) == 0
    res, md = written(tmp_path, "quality.json")
    assert res["recipe"]["trained_precision"] == "bf16" and res["recipe"]["steps"] == 2
    # the kernel train.attention auto chose, as the run's checkpoint recorded it
    kernel = res["recipe"]["trained_attention"]
    assert kernel in ATTENTION_KERNELS and f"bf16 with the {kernel} attention kernel" in md
    assert {"bleu", "chrf", "ter", "bleu_signature"} <= set(res["recipe"])
    assert [(r["toolkit"], r["selection"]) for r in res["budget"]["rows"]] == [
        ("transformer-mt", "last"),
        ("transformer-mt", "own best"),
    ]
    assert [r["step"] for r in res["precision"]["rows"]] == [1, 2]  # validated at both steps
    text = section(md, "quality")
    assert text.startswith("## Quality (Multi30k En→De, test_2016_flickr, 1,000 sentences)")
    assert "### Equal budget: 1 minutes of training" in text
    assert "### bf16 against fp32 at equal steps" in text
    assert res["history"][-1]["config"] == str(recipe)
    history = section((tmp_path / "history.md").read_text(), "experiments")
    assert history.splitlines()[-1].startswith(f"| {res['date']} |")


def test_big_corpus(tiny, tmp_path):
    sets = [a for o in [*TINY, "train.max_steps=2", "train.precision=fp32"] for a in ("--set", o)]
    argv = ["--pairs", "300", "--workdir", str(tmp_path / "big"), *sets]
    assert bench_bigcorpus.main([*argv, *outputs(tmp_path, "big.json")]) == 0
    res, md = written(tmp_path, "big.json")
    assert res["pairs"] == 300 and res["train_steps"] == 2 and res["d_model"] == 32
    assert res["prepare_peak_rss_mb"] > 0 and res["train_peak_rss_mb"] > 0
    text = section(md, "bigcorpus")
    assert text.startswith("## A corpus of 300 pairs")
    assert "| training, first 2 steps (d 32, 400-token batches) |" in text


def test_serving(tiny, tmp_path):
    argv = ["--checkpoint", str(tiny.run), "--requests", "6", "--rounds", "1"]
    argv += ["--clients", "1", "4"]
    assert bench_serve.main([*argv, *outputs(tmp_path, "serve.json")]) == 0
    res, md = written(tmp_path, "serve.json")
    assert res["requests"] == 6 and list(res["levels"]) == ["1", "4"]
    assert all(v["errors"] == 0 and v["requests_per_s"] > 0 for v in res["levels"].values())
    assert section(md, "serving").startswith("## Serving (`tmt serve`, `scripts/bench_serve.py`)")


def test_soak(tiny, tmp_path):
    argv = ["--checkpoint", str(tiny.run), "--minutes", "0.05"]
    argv += ["--max-work", "4096", "--batch-work", "1024", "--max-lines", "8"]
    assert soak_serve.main([*argv, *outputs(tmp_path, "soak.json")]) == 0
    res, md = written(tmp_path, "soak.json")
    assert res["limits"]["max_lines"] == 8 and res["default_limits"] is False
    assert res["worker"]["server_exited"] is False
    # every malformed body is refused as such, never a 500
    assert set(res["responses"]["malformed"]) <= {"400", "413"}
    assert "one sentence" in res["responses"] and len(res["targets_met"]) == 4
    text = section(md, "soak")
    assert text.startswith("## Serving under load (`tmt serve`, `scripts/soak_serve.py`)")
    assert "with the server's limits (4,096 steps a request, 1,024 a model call, 8 lines" in text


def test_allocator(tiny, tmp_path):
    argv = ["--config", str(tiny.config), "--run", str(tiny.run), "--steps", "3", "--rounds", "1"]
    assert bench_allocator.main([*argv, *outputs(tmp_path, "alloc.json")]) == 0
    res, md = written(tmp_path, "alloc.json")
    assert [len(v) for v in res["runs"].values()] == [1, 1] and res["steps"] == 3
    assert all(m["tok_s"] > 0 and 0 <= m["kernel_share"] <= 1 for m in res["median"].values())
    assert section(md, "allocator").startswith("### malloc keeping freed memory (CPU training)")


def test_demo_from_a_fresh_clone(tmp_path):
    """The demo's own steps in a clone, cut to a tiny model: bench_demo reads BLEU, the samples
    and the updates from what the commands print."""
    py = shlex.quote(sys.executable)
    tmt = f"{py} -m transformer_mt"
    sets = " ".join(f"--set {o}" for o in [*TINY, "train.max_steps=2", "train.max_minutes=0"])
    command = " && ".join(
        [
            f"{py} -m transformer_mt.demo_corpus data/demo --train 300 --valid 16 --test 16",
            f"{tmt} train configs/demo.yaml {sets} --set train.precision=fp32",
            f"{tmt} evaluate --checkpoint runs/demo --beam 1",
            f"{tmt} translate --checkpoint runs/demo --beam 1 < configs/demo_samples.en | paste -d "
            "'\\n' configs/demo_samples.en - | sed 'n;s/^/  -> /'",
        ]
    )
    argv = ["--command", command, *outputs(tmp_path, "demo.json")]
    assert bench_demo.main(argv) == 0
    res, md = written(tmp_path, "demo.json")
    assert res["exit_status"] == 0 and res["updates"] == 2
    assert res["bleu"] is not None and res["signature"].startswith("BLEU|")
    assert len(res["samples"]) == 5  # one translation per sample line, whatever it says
    assert section(md, "demo").startswith("## `make demo` from a fresh clone")


def test_finetune(tiny, tmp_path):
    """The tiny run as the parent, fine-tuned 3 updates on a tiny demo corpus the bench generates
    itself; both models scored on both test sets."""
    argv = ["--parent", str(tiny.run), "--demo-sizes", "120", "8", "8", "--workdir", str(tmp_path)]
    argv += ["--minutes", "0", "--steps", "3", "--warmup", "2", "--valid-every", "3", "--beam", "1"]
    assert bench_finetune.main([*argv, *outputs(tmp_path, "finetune.json")]) == 0
    res, md = written(tmp_path, "finetune.json")
    assert res["train"]["steps"] == 3 and res["train"]["parent_step"] == 3
    assert (
        res["train"]["unk_src_percent"] is not None and res["corpus_pairs"] == "120 training pairs"
    )
    assert [r["model"] for r in res["rows"]] == ["parent", "fine-tuned"]
    for row in res["rows"]:
        assert row["new"]["sentences"] == 8 and row["old"]["sentences"] == 16
        assert all(0 <= row[k]["bleu"] <= 100 and row[k]["beam"] == 1 for k in ("new", "old"))
    assert res["rows"][1]["new"]["checkpoint"].startswith(str(tmp_path / "run"))
    text = section(md, "finetune")
    assert text.startswith("## Fine-tuning the Multi30k model on the demo grammar (`scripts/")
    assert "| model | the demo grammar BLEU | Multi30k BLEU | signature |" in text
    assert "3 fine-tuning updates in " in text and "<unk> pieces make" in text
    # the report is rewritten from the JSON alone
    (tmp_path / "BENCHMARKS.md").unlink()
    assert bench_finetune.main(["--report-only", *outputs(tmp_path, "finetune.json")]) == 0
    assert section(written(tmp_path, "finetune.json")[1], "finetune") == text


def test_ct2_agreement(tiny, tmp_path):
    argv = ["--checkpoint", str(tiny.run), "--src", f"{tiny.data}/test.en", "--limit", "4"]
    assert ct2_agreement.main([*argv, "--threads", "1", *outputs(tmp_path, "ct2.json")]) == 0
    res, md = written(tmp_path, "ct2.json")
    assert [s["sentences"] for s in res["settings"]] == [4, 2, 4, 2]
    for s in res["settings"]:
        assert s["identical"] + sum(s["differing"].values()) == s["sentences"]
    assert section(md, "ct2-agreement").startswith("## CTranslate2 against our engine")


def test_sweep(tiny, tmp_path):
    argv = [str(tiny.config), "--out", str(tmp_path), "--threads", "1"]
    assert sweep.main([*argv, "--set", "train.max_steps=2", "--variant", "tiny"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["tiny"]["steps"] == 2 and results["tiny"]["returncode"] == 0
    assert "| tiny | (none) | 2 |" in (tmp_path / "results.md").read_text()


def test_quality_avx2_row(tiny, tmp_path, monkeypatch):
    """--avx2: the recipe trains and is scored with AVX2 kernels only, in a run directory of its
    own, and the section gains a second row that says so; the first row's run is left alone."""
    for name in bench_quality.AVX2_ONLY:
        monkeypatch.setenv(name, "")  # restored after the test: main() sets them for its children
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        tiny.config.read_text().replace(f"output_dir: {tiny.run}", f"output_dir: {tmp_path / 'r'}")
    )
    sets = [a for o in [*TINY, "train.max_steps=2"] for a in ("--set", o)]
    argv = ["--recipe", str(recipe), "--test", f"{tiny.data}/test", "--avx2"]
    argv += ["--history", str(tmp_path / "history.md")]
    assert bench_quality.main([*argv, *sets, *outputs(tmp_path, "quality.json")]) == 0
    res, md = written(tmp_path, "quality.json")
    assert "recipe" not in res and res["recipe_avx2"]["avx2"] is True
    assert res["recipe_avx2"]["steps"] == 2 and (tmp_path / "r_avx2" / "checkpoints").is_dir()
    assert not (tmp_path / "r").exists()
    assert "with AVX2 kernels only (ATEN_CPU_CAPABILITY=avx2" in section(md, "quality")
    assert res["history"][-1]["cpu"].endswith("(AVX2 kernels)")


def test_speed_keeps_an_earlier_decoding_table_under_its_own_date(tmp_path):
    earlier = {"decoding": {"fairseq": {"sent_s": 1.0}}, "decoding_date": "D", "decoding_cpu": "C"}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(earlier))
    res = {"notes": ["decoding not compared: run `make bench-quality` first"]}
    bench.keep_earlier_decoding(res, path)
    assert res["decoding"] == earlier["decoding"] and res["decoding_cpu"] == "C"
    assert res["notes"] == [
        "the decoding table is the one measured on D on C: this run did not measure decoding"
    ]
    fresh = {"decoding": {"x": 1}, "notes": []}
    bench.keep_earlier_decoding(fresh, path)
    assert fresh == {"decoding": {"x": 1}, "notes": []}
    # a bench.json from before decoding_date: its decoding was measured in its own run
    path.write_text(json.dumps({"decoding": {"x": 2}, "date": "E", "decoding_cpu": "C"}))
    older = {"notes": []}
    bench.keep_earlier_decoding(older, path)
    assert older["decoding_date"] == "E"
    assert older["notes"][0].startswith("the decoding table is the one measured on E on C:")


def test_quality_variant_goes_to_the_history_only(tiny, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        tiny.config.read_text().replace(f"output_dir: {tiny.run}", f"output_dir: {tmp_path / 'r'}")
    )
    sets = [a for o in [*TINY, "train.max_steps=2"] for a in ("--set", o)]
    sets += ["--set", "data.subword_sampling.nbest=4"]
    argv = ["--recipe", str(recipe), "--test", f"{tiny.data}/test", "--variant"]
    argv += ["--history", str(tmp_path / "history.md")]
    # the recipe's own result, as an earlier run left it: the variant must leave it alone
    earlier = {"recipe_config": "configs/recipe.yaml", "date": "D", "cpu": "C"}
    earlier["recipe"] = {"bleu": 41.0, "chrf": 65.0, "ter": 44.0, "train_minutes": 59.0}
    earlier["recipe"] |= {"steps": 10, "epochs": 1, "tgt_tok_per_s": 5, "sentences_per_second": 1}
    earlier["recipe"] |= {"beam": 5, "evaluated": "best.pt", "bleu_signature": "S"}
    earlier["recipe"] |= {"chrf_signature": "S", "ter_signature": "S"}
    (tmp_path / "quality.json").write_text(json.dumps(earlier))
    assert bench_quality.main([*argv, *sets, *outputs(tmp_path, "quality.json")]) == 0
    res, md = written(tmp_path, "quality.json")
    assert res["recipe"] == {**earlier["recipe"], "date": "D", "cpu": "C"}
    assert res["variant"]["steps"] == 2 and (tmp_path / "r_variant" / "checkpoints").is_dir()
    text = section(md, "quality")
    assert "`tmt train configs/recipe.yaml` from a clean run directory on D on **C**" in text
    assert "| 41.00 | 65.00 |" in text and "with `--set" not in text  # the variant is not shown
    history = section((tmp_path / "history.md").read_text(), "experiments")
    assert "| 4-best, α 0.3 |" in history.splitlines()[-1]
    assert "data.subword_sampling.nbest=4" in history.splitlines()[-1]  # the changes column

"""`tmt export` to CTranslate2 and `--engine ctranslate2` (issue 15): the exported model computes
what ours computes, token for token and log-probability for log-probability, for every option of our
architecture."""

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import sacrebleu
import torch
from conftest import CORES
from helpers import tiny_model

from transformer_mt import demo_corpus, export, search
from transformer_mt.cli import main
from transformer_mt.config import load_config
from transformer_mt.data import read_split
from transformer_mt.errors import UserError
from transformer_mt.export import ExportError, cached_export, export_ctranslate2, is_export
from transformer_mt.inference import load_translator

ctranslate2 = pytest.importorskip("ctranslate2")
# One torch thread (conftest.py): the engines' agreement test took 90 s on two threads of two busy
# cores, 8 s on one.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
ROOT = Path(__file__).resolve().parents[1]
WORDS = "red blue green black white gold silver pink big small old new".split()
# The reversal models' settings over the tiny run's (conftest.py): two layers each, no dropout, the
# default learning rate, and beam 4 within |source| + 4 pieces.
REVERSAL = {
    "model": {
        "heads": 4,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "dropout": 0.0,
        "max_positions": 48,
    },
    "train": {"max_tokens": 400, "warmup": 20, "lr_factor": 2.0, "valid_bleu": False},
    "decode": {"beam": 4, "max_len_a": 1.0, "max_len_b": 4},
}


@pytest.fixture(scope="module")
def reversal(tmp_path_factory) -> Path:
    """A reversal task: the target is the source's words, upper-cased, in reverse order."""
    corpus = tmp_path_factory.mktemp("reversal")
    rng = random.Random(0)
    for split, n in (("train", 600), ("valid", 8), ("test", 60)):
        src = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9))) for _ in range(n)]
        (corpus / f"{split}.en").write_text("".join(s + "\n" for s in src))
        (corpus / f"{split}.de").write_text(
            "".join(" ".join(reversed(s.upper().split())) + "\n" for s in src)
        )
    return corpus


def reversal_run(
    make_tiny_run,
    corpus: Path,
    *,
    norm: str,
    tie: bool,
    joint: bool,
    steps: int = 40,
    activation: str = "relu",
) -> Path:
    """A small model trained for 40 updates on the reversal task: not converged, so its
    distributions are spread and any difference between the engines shows (more `steps`: one that
    has learned the task). Built once per test run (conftest.py: make_tiny_run)."""
    return make_tiny_run(
        corpus,
        model={**REVERSAL["model"], "norm": norm, "tie_embeddings": tie, "activation": activation},
        tokenizer={"joint": joint},
        train={**REVERSAL["train"], "max_steps": steps, "valid_every": steps},
        decode=REVERSAL["decode"],
    ).dir


@pytest.mark.parametrize(
    "norm, tie, joint, activation",
    [
        ("pre", True, True, "relu"),
        ("post", False, False, "relu"),
        ("pre", False, True, "relu"),
        ("post", True, False, "gelu"),
    ],
)
def test_float32_export_decodes_and_scores_as_ours(
    make_tiny_run, reversal, tmp_path, norm, tie, joint, activation
):
    run = reversal_run(
        make_tiny_run, reversal, norm=norm, tie=tie, joint=joint, activation=activation
    )
    out = export_ctranslate2(run, tmp_path / "ct2", "float32")
    ours = load_translator(run, device="cpu", precision="fp32")
    theirs = load_translator(out, engine="ctranslate2", device="cpu")
    assert theirs.tokenizer.joint == joint
    sources, references = read_split(ours.config.data, "test")
    a, b = ours.translate(sources, beam=1), theirs.translate(sources, beam=1)
    # greedy: every sentence, token for token
    assert [h[0].pieces for h in a] == [h[0].pieces for h in b]
    for x, y in zip(a, b):
        assert y[0].logprob == pytest.approx(x[0].logprob, abs=1e-3)
        assert y[0].token_logprobs == pytest.approx(x[0].token_logprobs, abs=1e-3)
    # Forced decoding of the references (not the model's own outputs): tmt score against
    # score_batch.
    sa, sb = ours.score(sources, references), theirs.score(sources, references)
    assert [s.tokens for s in sa] == [s.tokens for s in sb]
    for x, y in zip(sa, sb):
        assert y.token_logprobs == pytest.approx(x.token_logprobs, abs=1e-3)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo recipe (configs/demo.yaml) on its generated corpus at half its width, two layers a
    side and batches of 1,024 tokens, trained for 600 of its 800 updates: a real translation model
    (93 BLEU on the demo's test split, as int8 too) in 39 s on two threads of an AVX2-only EPYC
    (48-53 s on one, beside `make test`'s other worker), where the recipe's own model took 175 s
    for 300 updates on one. The same small model trained 300 updates of 2,048 tokens scored 78,
    and int8 cost it 2.6 points."""
    root = tmp_path_factory.mktemp("demo_export")
    demo_corpus.write_corpus(root / "data")
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    overrides = [
        f"data.train={root}/data/train",
        f"data.valid={root}/data/valid",
        f"data.test={root}/data/test",
        "model.d_model=64",
        "model.d_ff=256",
        "model.encoder_layers=2",
        "model.decoder_layers=2",
        "train.max_tokens=1024",
        "train.max_steps=600",
        "train.valid_every=300",
        "train.valid_bleu=false",
        "train.max_minutes=0",
        # this worker's cores, not the one thread this module keeps for its decoding tests: on two
        # cores of its own it trained a quarter faster than on one
        f"train.threads={min(2, CORES)}",
        f"output_dir={root}/run",
    ]
    assert cfg.train.max_steps == 800
    threads = torch.get_num_threads()
    try:
        assert (
            main(
                [
                    "-q",
                    "train",
                    str(ROOT / "configs" / "demo.yaml"),
                    *sum((["--set", o] for o in overrides), []),
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)  # train.threads set the whole process's
    sources, references = read_split(load_config(root / "run" / "config.yaml").data, "test")
    return {"run": root / "run", "root": root, "sources": sources, "references": references}


def _f32_export(demo) -> Path:
    """The demo model's float32 export, made by whichever test needs it first."""
    out = demo["root"] / "ct2_f32"
    if not out.exists():
        export_ctranslate2(demo["run"], out, "float32")
    return out


def _bleu(hyps, refs):
    return sacrebleu.corpus_bleu(hyps, [refs]).score


def test_beam_search_agrees_with_ours_on_the_demo_model(demo):
    out = _f32_export(demo)
    ours = load_translator(demo["run"], device="cpu", precision="fp32")
    theirs = load_translator(out, engine="ctranslate2", device="cpu")
    a = ours.translate_text(demo["sources"], beam=4)
    b = theirs.translate_text(demo["sources"], beam=4)
    same = sum(x == y for x, y in zip(a, b)) / len(a)
    assert same >= 0.99, [(x, y) for x, y in zip(a, b) if x != y][:5]
    assert abs(_bleu(a, demo["references"]) - _bleu(b, demo["references"])) <= 0.2
    # the model translates: agreement is not agreement on noise
    assert _bleu(a, demo["references"]) > 30


# int8 rounding flips a few near-tied words of the small demo model, more or fewer with the CPU's
# int8 kernels (0.65 BLEU on one Intel Xeon, under 0.5 on an AMD EPYC): the margin is what tells
# "quantized" from "broken", which costs tens of points.
INT8_BLEU_MARGIN = 1.5


def test_int8_in_both_engines_stays_within_a_bleu_point_and_a_half(demo):
    refs, sources = demo["references"], demo["sources"]
    reference = _bleu(
        load_translator(demo["run"], device="cpu", precision="fp32").translate_text(sources), refs
    )
    ours8 = load_translator(demo["run"], device="cpu", precision="int8")
    assert ours8.precision == "int8"
    quantized = [
        m
        for m in ours8.engine.model.modules()
        if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)
    ]
    assert quantized and not any(type(m) is torch.nn.Linear for m in ours8.engine.model.modules())
    out = export_ctranslate2(demo["run"], demo["root"] / "ct2_int8", "int8")
    assert (out / "model.bin").stat().st_size < 0.4 * (
        _f32_export(demo) / "model.bin"
    ).stat().st_size
    theirs8 = load_translator(out, engine="ctranslate2", device="cpu")
    assert theirs8.precision == "int8"
    for translator in (ours8, theirs8):
        assert abs(_bleu(translator.translate_text(sources), refs) - reference) <= INT8_BLEU_MARGIN


def test_cli_export_then_evaluate_with_the_engine(demo, capsys):
    out = demo["root"] / "ct2_cli"
    assert (
        main(
            [
                "-q",
                "export",
                "-c",
                str(demo["run"]),
                "--format",
                "ctranslate2",
                "--output",
                str(out),
                "--quantization",
                "int8",
            ]
        )
        == 0
    )
    for name in (
        "model.bin",
        "config.json",
        "spm.model",
        "tmt.json",
        "tmt_config.yaml",
        "README.md",
    ):
        assert (out / name).is_file(), name
    capsys.readouterr()
    assert main(["-q", "evaluate", "--engine", "ctranslate2", "-c", str(out), "--json"]) == 0
    ct2 = json.loads(capsys.readouterr().out)
    assert main(["-q", "evaluate", "-c", str(demo["run"]), "--json"]) == 0
    torch_result = json.loads(capsys.readouterr().out)
    assert (
        ct2["engine"] == "ctranslate2" and ct2["precision"] == "int8" and ct2["sentences"] == 1000
    )
    assert abs(ct2["bleu"] - torch_result["bleu"]) <= INT8_BLEU_MARGIN  # int8 against our fp32
    # A second export into the same directory is refused unless forced.
    assert main(["-q", "export", str(demo["run"]), "-o", str(out)]) == 2
    assert main(["-q", "export", str(demo["run"]), "-o", str(out), "--force"]) == 0


def test_a_checkpoint_decodes_with_the_engine_through_a_cache(demo, capsys):
    """--engine ctranslate2 on a run directory exports once into the run's ct2-cache/ and reuses
    it."""
    t1 = load_translator(demo["run"], engine="ctranslate2", device="cpu")
    cached = sorted((demo["run"] / "ct2-cache").iterdir())
    assert len(cached) == 1 and t1.engine.directory == cached[0]
    t2 = load_translator(demo["run"], engine="ctranslate2", device="cpu")
    assert (
        t2.engine.directory == cached[0] and sorted((demo["run"] / "ct2-cache").iterdir()) == cached
    )
    assert t1.step == t2.step == 600


def test_what_the_engine_cannot_do_is_refused_with_the_reason(demo, tmp_path, capsys):
    out = _f32_export(demo)
    assert main(["translate", "-c", str(out)]) == 2  # an export with the torch engine
    assert "--engine ctranslate2" in capsys.readouterr().err
    theirs = load_translator(out, engine="ctranslate2", device="cpu")
    with pytest.raises(Exception, match="our engine"):
        theirs.translate(["a cat sleeps ."], alignment=True)
    with pytest.raises(ExportError, match="ensembl"):
        load_translator([demo["run"], demo["run"]], engine="ctranslate2")
    with pytest.raises(ExportError, match="quantization"):
        export_ctranslate2(demo["run"], tmp_path / "x", "int4")


def test_missing_extra_names_it(monkeypatch, tmp_path, capsys):
    import builtins

    real_import = builtins.__import__

    def no_ct2(name, *args, **kwargs):
        if name == "ctranslate2":
            raise ImportError("No module named 'ctranslate2'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ct2)
    assert main(["export", str(tmp_path), "-o", str(tmp_path / "out")]) == 2
    assert "pip install 'transformer-mt[ct2]'" in capsys.readouterr().err


# --------------------------------------------------------------------------- issue 22: the cache,
# --force, agreement


@pytest.fixture(scope="module")
def tiny(make_tiny_run, reversal):
    """Two tiny runs on the reversal task: a joint and a separate vocabulary (the latter also one of
    the float32 test's). The joint one trains 100 updates: enough that its 4-piece beginnings and
    its empty output compete at a budget of 5."""
    return {
        "joint": reversal_run(make_tiny_run, reversal, norm="pre", tie=True, joint=True, steps=100),
        "separate": reversal_run(make_tiny_run, reversal, norm="post", tie=False, joint=False),
    }


def _reweigh(path: Path, factor: float, *, same_stat: bool = True) -> None:
    """Rewrite a checkpoint with one weight scaled: new content, the same size and modification time
    (once it has been written by torch.save, whose files of one structure are of one size)."""
    st = path.stat()
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    name = next(iter(ckpt["model"]))
    ckpt["model"][name] = ckpt["model"][name] * factor
    torch.save(ckpt, path)
    if same_stat:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_the_cache_is_keyed_by_content_and_keeps_the_three_most_recent(tiny, tmp_path):
    run = shutil.copytree(tiny["joint"], tmp_path / "run")
    ckpt, cache = run / "checkpoints" / "best.pt", run / "ct2-cache"
    _reweigh(ckpt, 1.0, same_stat=False)  # torch.save's layout from here on
    first = cached_export(ckpt, cache)
    os.utime(ckpt)  # touched: a new modification time, the same bytes
    assert cached_export(ckpt, cache) == first and list(cache.iterdir()) == [first]
    _reweigh(ckpt, 2.0)  # other weights behind the same size and modification time
    second = cached_export(ckpt, cache)
    assert second != first and is_export(second)
    assert json.loads((second / "tmt.json").read_text())["checkpoint"] == str(ckpt.resolve())
    made = [first, second]
    for factor in (3.0, 4.0):
        _reweigh(ckpt, factor)
        made.append(cached_export(ckpt, cache))
    assert len(set(made)) == 4
    # the least recently used went; no temporary is left
    assert sorted(cache.iterdir()) == sorted(made[1:])


def test_two_exports_of_one_checkpoint_at_once_leave_one_whole_export(tiny, tmp_path, monkeypatch):
    """While this process converts, another one converts the same checkpoint and puts it in place
    first (simulated without timing: this conversion runs the other one, start to end, before it
    returns). The first export in place stays, the second is discarded, and nothing is left
    half-written."""
    run = shutil.copytree(tiny["joint"], tmp_path / "run")
    ckpt, cache = run / "checkpoints" / "best.pt", run / "ct2-cache"
    real, other = export.export_ctranslate2, []

    def racing(*args, **kwargs):
        out = real(*args, **kwargs)
        if not other:
            other.append(None)
            other[0] = export.cached_export(ckpt, cache)  # the other process
        return out

    monkeypatch.setattr(export, "export_ctranslate2", racing)
    mine = export.cached_export(ckpt, cache)
    assert mine == other[0] and is_export(mine)
    assert list(cache.iterdir()) == [mine]
    assert load_translator(mine, engine="ctranslate2", device="cpu").translate_text(["red blue"])


def test_an_export_with_another_sentencepiece_model_is_refused_in_one_line(tiny, tmp_path, capsys):
    out = export_ctranslate2(tiny["joint"], tmp_path / "ct2")
    shutil.copy(tiny["separate"] / "spm.src.model", out / "spm.model")  # copied over by hand, say
    with pytest.raises(UserError) as e:
        load_translator(out, engine="ctranslate2", device="cpu")
    message = str(e.value)
    assert "tmt.json" in message and "spm.model" in message and "\n" not in message
    assert (
        main(
            [
                "score",
                "--engine",
                "ctranslate2",
                "-c",
                str(out),
                "--src",
                os.devnull,
                "--ref",
                os.devnull,
            ]
        )
        == 2
    )
    assert "spm.model" in capsys.readouterr().err


def test_force_replaces_an_earlier_export_whole(tiny, tmp_path):
    """A joint export overwritten by a separate-vocabulary one: no spm.model (nor any other file) of
    the first survives to be read instead of the new models."""
    out = export_ctranslate2(tiny["joint"], tmp_path / "ct2")
    (out / "notes.txt").write_text("left over")
    with pytest.raises(ExportError, match="--force"):
        export_ctranslate2(tiny["separate"], out)
    export_ctranslate2(tiny["separate"], out, force=True)
    assert not (out / "spm.model").exists() and not (out / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2"]  # no temporary beside it
    theirs = load_translator(out, engine="ctranslate2", device="cpu")
    ours = load_translator(tiny["separate"], device="cpu", precision="fp32")
    assert not theirs.tokenizer.joint
    sources, _ = read_split(ours.config.data, "test")
    assert ours.translate_text(sources, beam=1) == theirs.translate_text(sources, beam=1)
    # --force empties only a directory that holds an export: anything else is left alone.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep")
    with pytest.raises(ExportError, match="not a tmt export"):
        export_ctranslate2(tiny["joint"], mine, force=True)
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"]


def test_the_engines_agree_where_the_length_budget_decides(tiny, tmp_path, monkeypatch):
    """α 1.0, beam 5, and budgets that decide: --max-len 0 5 (4 pieces and EOS, whatever the source)
    and 1 1 (|source| + 1, EOS included: budgets differ sentence by sentence within a batch), on the
    test sources and on pairs of them joined. Every sentence comes out identical, piece for piece,
    unless our search met a near-tie (two candidates within 1e-4, or its two best finished
    translations): the two engines' log-probabilities differ by float rounding, so they may order
    those either way."""
    run = tiny["joint"]
    out = export_ctranslate2(run, tmp_path / "ct2")
    gaps: list[float] = []
    real_step = search.beam_step

    # records the smallest gap between ranked candidates
    def step(cum, cand_logp, cand_tok, n_cand):
        top, *rest = real_step(cum, cand_logp, cand_tok, n_cand)
        gap = (top[:, :-1] - top[:, 1:]).masked_fill(~torch.isfinite(top[:, 1:]), float("inf"))
        gaps.append(gap.min().item())
        return (top, *rest)

    monkeypatch.setattr(search, "beam_step", step)
    sources, _ = read_split(load_config(run / "config.yaml").data, "test")
    sources += [f"{a} {b}" for a, b in zip(sources[0::2], sources[1::2])]
    free = load_translator(
        run, device="cpu", precision="fp32", beam=5, alpha=1.0, max_len=(0.0, 40)
    )
    # The budget of 5 binds: most sentences' unconstrained translations are longer than 4 pieces.
    # (Which side then wins, the cut 4-piece hypotheses or the empty one, is a near thing that the
    # CPU's kernels tip during training: all empty on AVX2 kernels, 58 of 90 cut on AVX-512 ones.
    # Either way both engines must decide alike.)
    assert sum(len(h[0].pieces) > 4 for h in free.translate(sources)) > len(sources) // 2
    for max_len in ((0.0, 5), (1.0, 1)):
        ours = load_translator(
            run, device="cpu", precision="fp32", beam=5, alpha=1.0, max_len=max_len
        )
        theirs = load_translator(
            out, engine="ctranslate2", device="cpu", beam=5, alpha=1.0, max_len=max_len
        )
        clear = []
        for src in sources:  # one at a time, so that the gaps recorded are this sentence's
            gaps.clear()
            best, second = ours.translate([src], nbest=2)[0]
            clear.append(min(gaps) >= 1e-4 and best.score - second.score >= 1e-4)
        a = [h[0] for h in ours.translate(sources)]
        b = [h[0] for h in theirs.translate(sources)]
        assert sum(clear) >= 0.8 * len(sources), sum(clear)  # near-ties are the exception
        differ = [i for i in range(len(sources)) if clear[i] and a[i].pieces != b[i].pieces]
        # The one difference ct2._penalty documents: CTranslate2 picks which finished hypotheses to
        # return by its own length penalty, which favours longer ones more than GNMT's, so a shorter
        # best of ours (here the empty translation, on AVX2 kernels) can be left out. Then ours is
        # the shorter and the better by our ranking; anything else (a budget or search difference)
        # fails, and so does more than a few of these.
        penalty = [
            i for i in differ if len(a[i].pieces) < len(b[i].pieces) and a[i].score > b[i].score
        ]
        assert [i for i in differ if i not in penalty] == [] and len(penalty) <= 0.1 * len(
            sources
        ), max_len


def test_the_transformers_export_of_the_demo_model_translates_as_ours(demo):
    """Issue 24: greedy `generate` of the exported MarianMTModel (transformers alone, no tmt) equals
    `tmt translate --beam 1` on at least 99% of the demo test set, under one length budget.

    transformers stops at the export's `max_length` (the model's positions), tmt at 1.5 x source
    length + 10 pieces (the export's README says so): a loop of this under-trained model that our
    budget cuts runs on in transformers. A CI machine's model had 12 such lines in 1000, all equal
    up to our budget; so ours decodes here with the export's budget."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from transformer_mt.export_hf import export_transformers

    out = export_transformers(demo["run"], demo["root"] / "hf")
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    budget = model.generation_config.max_length - 1  # transformers counts the decoder's start token
    ours = load_translator(demo["run"], device="cpu", precision="fp32")
    sources = demo["sources"]
    found = ours.translate(sources, beam=1, max_len=(0, budget), token_scores=False)
    want = [hyps[0].text for hyps in found]
    got = []
    with torch.inference_mode():
        for i in range(0, len(sources), 100):
            batch = tok(sources[i : i + 100], return_tensors="pt", padding=True)
            got += tok.batch_decode(model.generate(**batch), skip_special_tokens=True)
    same = sum(a == b for a, b in zip(got, want))
    assert same >= 0.99 * len(sources), [(a, b) for a, b in zip(got, want) if a != b][:3]
    # agreement on translations, not on noise
    assert _bleu(ours.translate_text(sources, beam=1), demo["references"]) > 30


def test_a_scale_norm_model_is_refused_by_name():
    """CTranslate2's Transformer has LayerNorm (gamma, beta) only: ScaleNorm would be lost."""
    with pytest.raises(ExportError, match="model.norm_type"):
        export.model_spec(ctranslate2, tiny_model(norm_type="scale"), tokenizer=None)


def test_a_gated_feed_forward_is_refused_by_name():
    """Our swiglu's weights are not mapped onto CTranslate2's gated layer: refused, not lost."""
    with pytest.raises(ExportError, match="model.activation"):
        export.model_spec(ctranslate2, tiny_model(activation="swiglu"), tokenizer=None)

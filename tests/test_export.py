"""`tmt export` to CTranslate2 and `--engine ctranslate2` (issue 15): the exported model computes what ours
computes, token for token and log-probability for log-probability, for every option of our architecture."""

import json
import random
from pathlib import Path

import pytest
import sacrebleu
import torch

from transformer_mt import demo_corpus
from transformer_mt.cli import main
from transformer_mt.config import load_config
from transformer_mt.data import read_split
from transformer_mt.export import ExportError, export_ctranslate2
from transformer_mt.translate import load_translator

pytest.importorskip("ctranslate2")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
WORDS = "red blue green black white gold silver pink big small old new".split()


def tiny_run(root: Path, name: str, *, norm: str, tie: bool, joint: bool) -> Path:
    """A small model trained for 40 updates on a reversal task: not converged, so its distributions are
    spread and any difference between the engines shows."""
    corpus = root / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        rng = random.Random(0)
        for split, n in (("train", 600), ("valid", 8), ("test", 60)):
            src = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9))) for _ in range(n)]
            (corpus / f"{split}.en").write_text("".join(s + "\n" for s in src))
            (corpus / f"{split}.de").write_text("".join(" ".join(reversed(s.upper().split())) + "\n" for s in src))
    cfg = root / f"{name}.yaml"
    cfg.write_text(f"""
data: {{src_lang: en, tgt_lang: de, train: {corpus}/train, valid: {corpus}/valid, test: {corpus}/test}}
tokenizer: {{vocab_size: 60, joint: {str(joint).lower()}}}
model: {{d_model: 32, heads: 4, encoder_layers: 2, decoder_layers: 2, d_ff: 64, dropout: 0.0, max_positions: 48,
         norm: {norm}, tie_embeddings: {str(tie).lower()}}}
train: {{max_steps: 40, valid_every: 40, max_tokens: 400, warmup: 20, threads: 1, valid_bleu: false, device: cpu}}
decode: {{beam: 4, max_len_a: 1.0, max_len_b: 4}}
output_dir: {root / name}
""")
    assert main(["-q", "train", str(cfg)]) == 0
    return root / name


@pytest.mark.parametrize("norm, tie, joint", [("pre", True, True), ("post", False, False), ("pre", False, True),
                                              ("post", True, False)])
def test_float32_export_decodes_and_scores_as_ours(tmp_path, norm, tie, joint):
    run = tiny_run(tmp_path, "run", norm=norm, tie=tie, joint=joint)
    out = export_ctranslate2(run, tmp_path / "ct2", "float32")
    ours = load_translator(run, device="cpu", precision="fp32")
    theirs = load_translator(out, engine="ctranslate2", device="cpu")
    assert theirs.tokenizer.joint == joint
    sources, references = read_split(ours.config.data, "test")
    a, b = ours.translate(sources, beam=1), theirs.translate(sources, beam=1)
    assert [h[0].pieces for h in a] == [h[0].pieces for h in b]  # greedy: every sentence, token for token
    for x, y in zip(a, b):
        assert y[0].logprob == pytest.approx(x[0].logprob, abs=1e-3)
        assert y[0].token_logprobs == pytest.approx(x[0].token_logprobs, abs=1e-3)
    # Forced decoding of the references (not the model's own outputs): tmt score against score_batch.
    sa, sb = ours.score(sources, references), theirs.score(sources, references)
    assert [s.tokens for s in sa] == [s.tokens for s in sb]
    for x, y in zip(sa, sb):
        assert y.token_logprobs == pytest.approx(x.token_logprobs, abs=1e-3)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo recipe (configs/demo.yaml) on its generated corpus, trained for 300 of its 800 updates
    (about a minute): a real translation model, short of the demo's full accuracy."""
    root = tmp_path_factory.mktemp("demo_export")
    demo_corpus.write_corpus(root / "data")
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    overrides = [f"data.train={root}/data/train", f"data.valid={root}/data/valid", f"data.test={root}/data/test",
                 "train.max_steps=300", "train.valid_every=300", "train.valid_bleu=false", "train.max_minutes=0",
                 f"output_dir={root}/run"]
    assert cfg.train.max_steps == 800
    assert main(["-q", "train", str(ROOT / "configs" / "demo.yaml"), *sum((["--set", o] for o in overrides), [])]) == 0
    sources, references = read_split(load_config(root / "run" / "config.yaml").data, "test")
    return {"run": root / "run", "root": root, "sources": sources, "references": references}


def _bleu(hyps, refs):
    return sacrebleu.corpus_bleu(hyps, [refs]).score


def test_beam_search_agrees_with_ours_on_the_demo_model(demo):
    out = export_ctranslate2(demo["run"], demo["root"] / "ct2_f32", "float32")
    ours = load_translator(demo["run"], device="cpu", precision="fp32")
    theirs = load_translator(out, engine="ctranslate2", device="cpu")
    a = ours.translate_text(demo["sources"], beam=4)
    b = theirs.translate_text(demo["sources"], beam=4)
    same = sum(x == y for x, y in zip(a, b)) / len(a)
    assert same >= 0.99, [(x, y) for x, y in zip(a, b) if x != y][:5]
    assert abs(_bleu(a, demo["references"]) - _bleu(b, demo["references"])) <= 0.2
    assert _bleu(a, demo["references"]) > 30  # the model translates: agreement is not agreement on noise


def test_int8_in_both_engines_stays_within_half_a_bleu_point(demo):
    refs, sources = demo["references"], demo["sources"]
    reference = _bleu(load_translator(demo["run"], device="cpu", precision="fp32").translate_text(sources), refs)
    ours8 = load_translator(demo["run"], device="cpu", precision="int8")
    assert ours8.precision == "int8"
    quantized = [m for m in ours8.model.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert quantized and not any(type(m) is torch.nn.Linear for m in ours8.model.modules())
    out = export_ctranslate2(demo["run"], demo["root"] / "ct2_int8", "int8")
    assert (out / "model.bin").stat().st_size < 0.4 * (demo["root"] / "ct2_f32" / "model.bin").stat().st_size
    theirs8 = load_translator(out, engine="ctranslate2", device="cpu")
    assert theirs8.precision == "int8"
    for translator in (ours8, theirs8):
        assert abs(_bleu(translator.translate_text(sources), refs) - reference) <= 0.5


def test_cli_export_then_evaluate_with_the_engine(demo, capsys):
    out = demo["root"] / "ct2_cli"
    assert main(["-q", "export", "-c", str(demo["run"]), "--format", "ctranslate2", "--output", str(out),
                 "--quantization", "int8"]) == 0
    for name in ("model.bin", "config.json", "spm.model", "tmt.json", "tmt_config.yaml", "README.md"):
        assert (out / name).is_file(), name
    capsys.readouterr()
    assert main(["-q", "evaluate", "--engine", "ctranslate2", "-c", str(out), "--json"]) == 0
    ct2 = json.loads(capsys.readouterr().out)
    assert main(["-q", "evaluate", "-c", str(demo["run"]), "--json"]) == 0
    torch_result = json.loads(capsys.readouterr().out)
    assert ct2["engine"] == "ctranslate2" and ct2["precision"] == "int8" and ct2["sentences"] == 1000
    assert abs(ct2["bleu"] - torch_result["bleu"]) <= 0.5
    # A second export into the same directory is refused unless forced.
    assert main(["-q", "export", str(demo["run"]), "-o", str(out)]) == 2
    assert main(["-q", "export", str(demo["run"]), "-o", str(out), "--force"]) == 0


def test_a_checkpoint_decodes_with_the_engine_through_a_cache(demo, capsys):
    """--engine ctranslate2 on a run directory exports once into the run's ct2-cache/ and reuses it."""
    t1 = load_translator(demo["run"], engine="ctranslate2", device="cpu")
    cached = sorted((demo["run"] / "ct2-cache").iterdir())
    assert len(cached) == 1 and t1.directory == cached[0]
    t2 = load_translator(demo["run"], engine="ctranslate2", device="cpu")
    assert t2.directory == cached[0] and sorted((demo["run"] / "ct2-cache").iterdir()) == cached
    assert t1.step == t2.step == 300


def test_what_the_engine_cannot_do_is_refused_with_the_reason(demo, tmp_path, capsys):
    out = demo["root"] / "ct2_f32"
    if not out.exists():
        export_ctranslate2(demo["run"], out, "float32")
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

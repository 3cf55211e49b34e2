"""Shared test set-up: tokenized-corpus caches go to a temporary folder, not ~/.cache; torch threads
are restored; and the tiny trained model that the CLI, serving and reliability tests share, trained
once per test run (`tiny_run`), with `make_tiny_run` for the few tests that need another one."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml


@pytest.fixture(scope="session", autouse=True)
def _private_corpus_cache(tmp_path_factory):
    previous = os.environ.get("TMT_CACHE")
    os.environ["TMT_CACHE"] = str(tmp_path_factory.mktemp("tmt-cache"))  # subprocesses inherit it
    yield
    if previous is None:
        os.environ.pop("TMT_CACHE", None)
    else:
        os.environ["TMT_CACHE"] = previous


# `make test` runs the suite on pytest-xdist workers, one per core (`-n auto`): each computes on its
# share of the cores, as two workers of two torch threads each on two cores oversubscribe them.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_ALL = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
CORES = max(1, _ALL // WORKERS)  # counted as xdist counts them for -n auto


def pytest_configure(config):
    if WORKERS > 1:
        import torch

        torch.set_num_threads(CORES)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Runs with `train.threads: 1` set torch's global thread count; later tests must not inherit
    it."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a module's tests (`pytest.mark.usefixtures("one_thread")`): the
    test machine is small and shared, and torch's threads oversubscribe it (the engines' agreement
    test took 90 s on two threads of two busy cores, 8 s on one)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the tiny model

# The tiny corpus's words: a test that needs input the tiny model knows draws it from `sentences`.
WORDS = (
    "alpha beta gamma delta echo fox golf hotel india kilo lima mike nova oscar papa romeo sierra "
    "tango"
).split()
# Lines per split of the tiny corpus.
SPLITS = {"train": 400, "valid": 12, "test": 17}
# What every tiny run trains from, before its own overrides. Deterministic outputs: fp32 on the CPU
# on one thread (precision auto would let a timing probe decide).
TINY_CONFIG: dict[str, Any] = {
    "data": {"src_lang": "en", "tgt_lang": "de"},
    "tokenizer": {"vocab_size": 60},
    "model": {
        "d_model": 32,
        "heads": 2,
        "encoder_layers": 1,
        "decoder_layers": 1,
        "d_ff": 64,
        "max_positions": 128,
    },
    "train": {
        "max_steps": 500,
        "valid_every": 150,
        "log_every": 10,
        "max_tokens": 1024,
        "warmup": 60,
        "lr_factor": 1.0,
        "threads": 1,
        "device": "cpu",
        "precision": "fp32",
    },
    "decode": {"beam": 2, "max_len_b": 5},
}
# The shared run: 300 updates of TINY_CONFIG (about 5 s on one core), enough to copy its input (BLEU
# 87 to 100 on the test split over training seeds 1 to 3).
SHARED_STEPS = 300


@dataclass(frozen=True)
class TinyRun:
    """A trained run: its run directory, the YAML it was trained from (the overrides were given as
    `--set`, so the YAML does not hold them) and the corpus folder (`train.en`, `test.de`, ...)."""

    dir: Path
    config: Path
    corpus: Path


def random_sentences(n: int, seed: int, length: tuple[int, int] = (2, 6)) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*length))) for _ in range(n)]


@pytest.fixture(scope="session")
def sentences() -> Callable[..., list[str]]:
    """`sentences(n, seed, length=(2, 6))`: n random sentences of the tiny corpus's words, each of a
    length in that range."""
    return random_sentences


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A copy task (the target is the source) over WORDS, in `{train,valid,test}.{en,de}`: a model
    that has learned it gives translations that are real sentences (words to show, attention to
    draw)."""
    corpus = tmp_path_factory.mktemp("tiny-corpus")
    for seed, (split, n) in enumerate(SPLITS.items()):
        text = "".join(line + "\n" for line in random_sentences(n, seed))
        for lang in ("en", "de"):
            (corpus / f"{split}.{lang}").write_text(text, encoding="utf-8")
    return corpus


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Training sets torch's thread count (train.threads) and the package logger's level: the tests
    that run after must not inherit either."""
    import torch

    threads, logger = torch.get_num_threads(), logging.getLogger("transformer_mt")
    level = logger.level
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        logger.setLevel(level)


@pytest.fixture(scope="session")
def make_tiny_run(tmp_path_factory, tiny_corpus, _private_corpus_cache) -> Callable[..., TinyRun]:
    """`make_tiny_run(corpus=None, **sections)`: a run of TINY_CONFIG on `corpus` (the tiny corpus
    unless given) with the settings `sections` overrides (`train={"max_steps": 2}`), trained once
    per test run through `tmt train`; the same arguments again return the same run. Tests share the
    runs: one that would change a run's checkpoints, config or tokenizer works on a copy."""
    from transformer_mt.cli import main

    built: dict[str, TinyRun] = {}

    def make(corpus: Path | None = None, **sections: dict[str, Any]) -> TinyRun:
        corpus = corpus or tiny_corpus
        key = json.dumps([str(corpus), sections], sort_keys=True)
        if key in built:
            return built[key]
        root = tmp_path_factory.mktemp("tiny-run")
        raw = copy.deepcopy(TINY_CONFIG)
        raw["data"].update({split: str(corpus / split) for split in SPLITS})
        raw["output_dir"] = str(root / "run")
        config = root / "tiny.yaml"
        config.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        sets = [
            arg
            for section, values in sections.items()
            for name, value in values.items()
            for arg in ("--set", f"{section}.{name}={json.dumps(value)}")
        ]
        with _process_state_kept():
            assert main(["-q", "train", str(config), *sets]) == 0, sets
        built[key] = TinyRun(root / "run", config, corpus)
        return built[key]

    return make


@pytest.fixture
def copy_config(tmp_path) -> Callable[..., Any]:
    """`copy_config(n_train=200, **train)`: the Config of a small model (2 + 2 layers, d_model 64,
    no dropout, fp32) on a copy task of six colour words in this test's tmp_path
    (`{train,valid}.{src,tgt}`, written on the first call; the run goes to tmp_path/run), with
    `train` settings overridden: for tests that drive the Trainer themselves."""
    from transformer_mt.config import config_from_dict

    written: list[int] = []

    def make(n_train: int = 200, **train: Any) -> Any:
        if not written:
            rng = random.Random(0)
            words = "red blue green black white gold".split()
            for split, n in (("train", n_train), ("valid", 60)):
                lines = [
                    " ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) for _ in range(n)
                ]
                for lang in ("src", "tgt"):
                    (tmp_path / f"{split}.{lang}").write_text("".join(x + "\n" for x in lines))
            written.append(n_train)
        assert written == [n_train], "one corpus per test"
        return config_from_dict(
            {
                "data": {
                    "src_lang": "src",
                    "tgt_lang": "tgt",
                    "train": str(tmp_path / "train"),
                    "valid": str(tmp_path / "valid"),
                },
                "tokenizer": {"vocab_size": 40},
                "model": {
                    "d_model": 64,
                    "heads": 4,
                    "encoder_layers": 2,
                    "decoder_layers": 2,
                    "d_ff": 128,
                    "dropout": 0.0,
                    "max_positions": 64,
                },
                "train": {
                    "max_tokens": 1024,
                    "warmup": 60,
                    "lr_factor": 1.0,
                    "log_every": 50,
                    "valid_every": 1000,
                    "valid_bleu": False,
                    "keep_last": 0,
                    "seed": 3,
                    "precision": "fp32",
                    "attention": "fused",  # not timed: runs a test compares match bit for bit
                    **train,
                },
                "output_dir": str(tmp_path / "run"),
            }
        )

    return make


@pytest.fixture(scope="session")
def tiny_run(make_tiny_run) -> TinyRun:
    """The tiny model the CLI, serving and reliability tests share: TINY_CONFIG trained for
    SHARED_STEPS updates, validated (and checkpointed) every 150."""
    return make_tiny_run(train={"max_steps": SHARED_STEPS})

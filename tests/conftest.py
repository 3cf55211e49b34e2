"""Shared test set-up: tokenized-corpus caches go to a temporary folder, not ~/.cache; torch threads
are restored."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_corpus_cache(tmp_path_factory):
    previous = os.environ.get("TMT_CACHE")
    os.environ["TMT_CACHE"] = str(tmp_path_factory.mktemp("tmt-cache"))  # subprocesses inherit it
    yield
    if previous is None:
        os.environ.pop("TMT_CACHE", None)
    else:
        os.environ["TMT_CACHE"] = previous


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Runs with `train.threads: 1` set torch's global thread count; later tests must not inherit
    it."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)

"""Shared test set-up: tokenized-corpus caches go to a temporary folder, not ~/.cache."""

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

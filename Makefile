# transformer-mt: `make demo` and `make test` each work on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch goes in first, pinned, so that no dependency resolves a newer CUDA build on a
# CPU machine. Elsewhere: make install TORCH_SPEC=torch TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC     ?= torch==2.13.0
TORCH_PIP_ARGS ?=

.PHONY: install demo lint test test-browser bench bench-quality docs-figure clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The main job on the built-in demo corpus: the same commands a user types.
demo: install
	$(PY) -m transformer_mt.demo_corpus data/demo
	rm -rf runs/demo
	$(VENV)/bin/tmt train configs/demo.yaml
	$(VENV)/bin/tmt evaluate --checkpoint runs/demo --beam 4
	$(VENV)/bin/tmt translate --checkpoint runs/demo --beam 4 < configs/demo_samples.en | paste -d '\n' configs/demo_samples.en - | sed 'n;s/^/  -> /'

# ruff (pinned in the dev extra, configured in pyproject.toml): the formatter decides layout, the
# linter finds unused names, import order and functions too complex to read at once.
lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# One pytest-xdist worker per core, each test file's tests on one worker (so that a module's fixture
# trains once); tests/conftest.py gives each worker its share of the cores as torch threads.
test: install
	$(PY) -m pytest -q -n auto --dist loadfile

# The served page in headless Chromium (Debian's chromium and chromium-driver, installed when missing).
test-browser: install
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { apt-get update -q && apt-get install -y -q chromium chromium-driver; }
	$(PY) -m pytest -q -m browser

# Speed side by side with the peers (../shared/peers, optional), natively and with AVX2 kernels only,
# serving under load, and `make demo` from a fresh clone with AVX2 kernels only -> BENCHMARKS.md,
# bench*.json.
bench: install
	$(PY) -m scripts.bench --avx2
	$(PY) -m scripts.bench_serve
	$(PY) -m scripts.soak_serve
	$(PY) -m scripts.bench_allocator
	$(PY) -m scripts.bench_demo --avx2

# The Multi30k recipe end to end (about an hour), again with AVX2 kernels only, and a 20-minute
# budget race with fairseq.
bench-quality: install
	$(PY) -m scripts.bench_quality --budget 20 --fp32-steps 600
	$(PY) -m scripts.bench_quality --avx2
	$(PY) -m scripts.bench_finetune

# The README's figures, drawn by the code: the demo model's attention (run `make demo` first) and
# the served page as the browser test leaves it.
docs-figure: install test-browser
	$(VENV)/bin/tmt translate --checkpoint runs/demo --plot-attention runs/demo/plots < configs/demo_samples.en > /dev/null
	cp runs/demo/plots/1.png docs/attention.png
	cp runs/browser/page.png docs/serve-page.png

clean:
	rm -rf $(VENV) runs build *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

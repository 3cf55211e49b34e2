"""The benchmarks, as tools: run each from the repository root as `python -m scripts.<name>`
(`make bench`, `make bench-quality`); what they share is in `scripts.benchlib`."""

"""The README documents every config key and every CLI flag, so docs cannot drift from code."""

import dataclasses
from pathlib import Path

from transformer_mt.cli import build_parser
from transformer_mt.config import Config

README = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")


def test_every_config_key_is_in_the_readme_reference():
    missing = []
    for section in dataclasses.fields(Config):
        value = getattr(Config(), section.name)
        if not dataclasses.is_dataclass(value):
            assert f"`{section.name}`" in README
            continue
        assert f"### `{section.name}`" in README, f"README lacks a section for {section.name}"
        missing += [
            f"{section.name}.{f.name}"
            for f in dataclasses.fields(value)
            if f"`{f.name}`" not in README
        ]
    assert not missing, f"config keys missing from README: {missing}"


def test_readme_starts_with_the_two_setup_commands():
    head = README[:1200]
    assert "make demo" in head and "make test" in head


def test_every_cli_flag_is_in_the_readme():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        for action in p._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert flag in README, f"tmt {name} {flag} is not mentioned in README.md"


def test_the_readmes_figures_for_the_demo_and_the_server_are_the_codes():
    """Issue 22, item 20: the README promised a demo budget and a batch bound that the code did not
    keep."""
    from transformer_mt.config import load_config
    from transformer_mt.serve import Limits

    demo = load_config(Path(__file__).parent.parent / "configs" / "demo.yaml").train
    assert (
        f"`train.max_minutes: {demo.max_minutes:g}`" in README
        and f"{demo.max_steps} updates" in README
    )
    assert demo.cooldown > 0  # the README says a run cut short by the budget ends annealed
    limits = Limits()
    assert f"`--batch-lines` lines, {limits.batch_lines}" in README
    assert f"`--max-work` ({limits.max_work:,} steps)" in README


def test_the_readme_claims_no_decoding_row_that_the_bench_does_not_measure():
    import re

    scripts = Path(__file__).parent.parent / "scripts"
    if "joey" not in (scripts / "bench_decode.py").read_text(encoding="utf-8").lower():
        assert not re.search(r"decod[^.]*JoeyNMT", README), (
            "README says JoeyNMT decoding is measured; nothing does"
        )

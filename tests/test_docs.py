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
        missing += [f"{section.name}.{f.name}" for f in dataclasses.fields(value) if f"`{f.name}`" not in README]
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

"""The package's shape (issue 11): each concern in one module, imports flowing one way, short
definitions."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "transformer_mt"


def _tree(name: str) -> ast.Module:
    return ast.parse((PACKAGE / f"{name}.py").read_text(encoding="utf-8"))


def _package_imports(name: str) -> set[str]:
    """The package modules a module imports (relative imports: `from .x import y`)."""
    found = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.add(node.module or "")
    return found


@pytest.mark.parametrize(
    "module, allowed",
    [
        ("model", {"config", "vocab"}),  # torch only: no tokenizer, no data
        ("vocab", set()),
        ("runtime", set()),
        ("distributed", set()),
        ("config", {"errors", "fileio"}),
    ],
)
def test_low_modules_import_only_what_is_below_them(module, allowed):
    assert _package_imports(module) <= allowed


def test_training_does_not_import_inference_set_up():
    """train.py validates with search.translate_ids; translate.py (loading checkpoints for
    inference) and evaluate.py (the `tmt evaluate` job) sit beside it, not below it."""
    assert not _package_imports("train") & {"translate", "evaluate", "cli"}


def test_nothing_but_cli_imports_cli():
    assert not [
        p.name
        for p in PACKAGE.glob("*.py")
        if p.stem not in ("cli", "__main__") and "cli" in _package_imports(p.stem)
    ]


def test_only_cli_imports_the_server_and_the_plots():
    """serve.py and plot.py are thin layers over translate.py, each behind an optional extra."""
    users = {p.stem for p in PACKAGE.glob("*.py") if _package_imports(p.stem) & {"serve", "plot"}}
    assert users <= {"cli"}


def test_the_engines_do_not_import_each_other():
    """STYLE.md: translate.py (ours) sits below ct2.py (CTranslate2's, which uses its types);
    inference.py picks between them. translate.py importing ct2, even lazily, made a cycle."""
    assert "ct2" not in _package_imports("translate") and "inference" not in _package_imports("ct2")

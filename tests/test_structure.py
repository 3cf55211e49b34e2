"""The package's shape (issues 11 and 23): each concern in one module, imports flowing one way.

Imports are read from the source with the AST, lazy ones (inside functions) included: a lazy
import hides a cycle from Python's import machinery, not from a reader.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "transformer_mt"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py"))


def package_imports(name: str) -> set[str]:
    """The package modules that module `name` imports, anywhere in it: `from .x import y`,
    `from . import x`, `import transformer_mt.x`, `from transformer_mt.x import y`."""
    found = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{name}.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1 and module:
                found.add(module.split(".")[0])
            elif node.level == 1:  # from . import x
                found.update(a.name for a in node.names)
            elif module.startswith("transformer_mt."):
                found.add(module.split(".")[1])
            elif module == "transformer_mt":
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.split(".")[1] for a in node.names if a.name.startswith("transformer_mt.")
            )
    return found & set(MODULES)


GRAPH = {m: package_imports(m) for m in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the import graph as a path [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_lazy_cycle_and_passes_a_tree():
    """The checker itself can fail: a cycle through three modules is found, a tree is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    lazy = "def f():\n    from .translate import x\n"
    assert any(
        isinstance(n, ast.ImportFrom) and n.module == "translate" and n.level == 1
        for n in ast.walk(ast.parse(lazy))
    )


def test_the_package_has_no_import_cycle_even_through_lazy_imports():
    assert find_cycle(GRAPH) is None


def test_the_graph_sees_lazy_imports():
    """cli imports its subcommands' modules inside the functions that run them; the graph has
    them, or the cycle test above would check nothing of the lazy imports."""
    assert {"train", "inference", "serve", "export"} <= GRAPH["cli"]


@pytest.mark.parametrize(
    "module, allowed",
    [
        ("model", {"config", "vocab"}),  # torch only: no tokenizer, no data
        ("vocab", set()),
        ("runtime", set()),
        ("distributed", set()),
        ("config", {"errors", "fileio"}),
        ("search", {"model", "vocab"}),  # id tensors in, hypotheses out: no corpora, no batching
    ],
)
def test_low_modules_import_only_what_is_below_them(module, allowed):
    assert GRAPH[module] <= allowed


def test_search_batches_nothing_and_the_engines_do_not_import_each_other():
    """STYLE.md: search works against model.encode/decode alone; translate.py (ours) and ct2.py
    (CTranslate2) implement decoding.Engine side by side; inference.py picks between them."""
    assert not GRAPH["search"] & {"data", "translate"}
    assert not GRAPH["translate"] & {"ct2", "export", "inference"}
    assert not GRAPH["ct2"] & {"translate", "inference"}
    assert not GRAPH["decoding"] & {"translate", "ct2", "inference"}


def test_nothing_but_cli_imports_cli_serve_export_or_plot():
    """serve, export and plot are layers over inference.py, each behind an optional extra; the
    CTranslate2 engine may call the exporter to convert a run on first use."""
    allowed = {"cli", "__main__"}
    for module in ("cli", "serve", "plot"):
        assert {m for m in MODULES if module in GRAPH[m]} <= allowed, module
    assert {m for m in MODULES if "export" in GRAPH[m]} <= allowed | {"ct2", "export_hf"}
    assert {m for m in MODULES if "export_hf" in GRAPH[m]} <= allowed


def test_no_test_module_imports_another():
    """STYLE.md: shared things go to conftest.py (fixtures) or tests/helpers.py, so that a test
    module can be read, run and changed alone."""
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert not found

"""The README and docs/ against what they describe: every figure against the benchmark section it
links to, every link against its target, the config and command references against the dataclasses
and the parser, the module map against the imports. Each test fails when a page drifts."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from transformer_mt.cli import build_parser
from transformer_mt.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
NUMBER = re.compile(r"(?<![\w.,])\d+(?:,\d{3})*(?:\.\d+)?")


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def prose(text: str) -> str:
    """The text without fenced code blocks (a `#` comment in one is no heading)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(text: str) -> dict[str, str]:
    """Each heading's anchor -> its text up to the next heading of the same or a higher level
    (GitHub numbers repeated anchors -1, -2, ...)."""
    lines = prose(text).splitlines()
    heads = [
        (i, len(m[1]), m[2]) for i, ln in enumerate(lines) if (m := re.match(r"(#+) (.*)", ln))
    ]
    out, seen = {}, {}
    for k, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1 :] if lv <= level), len(lines))
        anchor = slug(title)
        n = seen.get(anchor, 0)
        seen[anchor] = n + 1
        out[anchor if n == 0 else f"{anchor}-{n}"] = "\n".join(lines[i:end])
    return out


def links(text: str) -> list[tuple[str, str]]:
    """(link text, target) of each Markdown link outside code: code spans are blanked first."""
    text = re.sub(r"`[^`]*`", lambda m: "`" + "x" * (len(m[0]) - 2) + "`", prose(text))
    return LINK.findall(text)


def local(target: str) -> bool:
    return not re.match(r"[a-z]+:", target)


def resolve(page: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return ((page.parent / path).resolve() if path else page), anchor


# --------------------------------------------------------------------------- links and figures


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves_to_a_file_and_a_heading(page):
    broken = []
    for _, target in links(read(page)):
        if not local(target):
            continue
        path, anchor = resolve(page, target)
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in sections(read(path)):
            broken.append(f"{target}: no heading #{anchor} in {path.name}")
    assert not broken, f"{page.name}: {broken}"


def blocks(text: str) -> list[str]:
    """Paragraphs and list items of a page's prose, headings left out."""
    out = []
    for para in re.split(r"\n\s*\n", prose(text)):
        items = re.split(r"\n(?=- )", para)
        out += [b for b in items if not b.startswith("#")]
    return out


def test_every_readme_figure_is_in_the_benchmark_section_it_links_to():
    """Issue 23, item 7: each measured claim links to where it was measured. A figure in the
    README's prose (a paragraph or a list item) must appear in a section that the same paragraph
    links to, so that a figure typed by hand, or left behind by a new benchmark run, fails."""
    readme = ROOT / "README.md"
    wrong = []
    for block in blocks(read(readme)):
        figures = NUMBER.findall(re.sub(r"\]\([^)]*\)", "]", block))
        if not figures:
            continue
        targets = [resolve(readme, t) for _, t in links(block) if local(t) and "#" in t]
        measured = [sections(read(path)).get(anchor, "") for path, anchor in targets]
        if not measured:
            wrong.append(f"{figures} with no link to where they were measured: {block[:60]!r}")
        for figure in figures:
            pattern = rf"(?<![\w.,]){re.escape(figure)}(?!\d|[.,]\d)"
            if not any(re.search(pattern, text) for text in measured):
                wrong.append(f"{figure} is not in {[t for _, t in links(block)]}")
    assert not wrong, wrong


def test_the_readmes_results_hold_figures():
    """The check above passes on a README without figures; the front page promises results, from
    the recipe's quality to the demo."""
    results = sections(read(ROOT / "README.md"))["results"]
    assert len(NUMBER.findall(re.sub(r"\]\([^)]*\)", "]", results))) >= 10
    assert "BENCHMARKS.md#quality" in results and "BENCHMARKS.md#make-demo" in results


def test_readme_starts_with_the_two_setup_commands():
    readme = read(ROOT / "README.md")
    first = FENCE.search(readme)
    commands = [ln.split("#")[0].strip() for ln in first[0].splitlines()[1:-1]]
    assert commands == ["make demo", "make test"], commands
    assert first.start() < 1200 and "## Set-up" in readme[: first.start()]
    targets = re.findall(r"^([\w-]+):", read(ROOT / "Makefile"), re.M)
    assert {"demo", "test", "install"} <= set(targets)


def test_the_api_page_starts_from_the_readme_example():
    """docs/python-api.md sends the reader to the README's example, which test_cli.py runs."""
    readme = read(ROOT / "README.md")
    example = readme.split("## Python API\n", 1)[1].split("```python\n", 1)[1].split("```")[0]
    assert example.startswith("from transformer_mt import load")
    assert "](../README.md#python-api)" in read(DOCS / "python-api.md")


# --------------------------------------------------------------------------- the config reference


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the Markdown tables in `text`, as cells (escaped pipes kept in cells)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"\|\s*-", line):
            rows.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return [r for r in rows if r and r[0] not in ("key", "flag", "field", "target", "endpoint")]


def literal(cell: str):
    """A default as the page writes it (`en`, 8000, true, [0.9, 0.98], 1e-9) as a value."""
    value = yaml.safe_load(cell.strip("`"))
    if isinstance(value, str):
        try:
            return float(value.replace(",", ""))
        except ValueError:
            return value
    return value


def test_the_config_reference_lists_exactly_the_config_keys_and_defaults():
    page = read(DOCS / "config.md")
    anchors = sections(page)
    defaults = Config()
    wrong = []
    for section in dataclasses.fields(Config):
        value = getattr(defaults, section.name)
        if not dataclasses.is_dataclass(value):
            assert f"`{section.name}`" in page and f"`{value}`" in page, section.name
            continue
        rows = table_rows(anchors.get(section.name, ""))
        documented = [row[0].strip("`") for row in rows]
        names = [f.name for f in dataclasses.fields(value)]
        if sorted(documented) != sorted(names):
            wrong.append(
                f"{section.name}: documented {sorted(set(documented) - set(names))} not in the "
                f"code; {sorted(set(names) - set(documented))} missing"
            )
        for row in rows:
            field = next(
                (f for f in dataclasses.fields(value) if f.name == row[0].strip("`")), None
            )
            if field is None or field.default is None or field.default is dataclasses.MISSING:
                continue  # None: the page says in words what takes its place
            default = list(field.default) if isinstance(field.default, tuple) else field.default
            if literal(row[1]) != default:
                wrong.append(f"{section.name}.{field.name}: page {row[1]!r}, code {default!r}")
    assert not wrong, wrong


# --------------------------------------------------------------------------- the command reference


def subcommands() -> dict:
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices


def flags(parser) -> set[str]:
    return {f for a in parser._actions for f in a.option_strings if f not in ("-h", "--help")}


def synopsis_flags(section: str) -> set[str]:
    """The flags in a section's first code block, the command's synopsis."""
    block = FENCE.search(section)
    assert block, "no synopsis"
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", block[0]))


def test_every_command_has_a_synopsis_with_exactly_its_flags():
    page = read(DOCS / "commands.md")
    anchors = sections(page)
    assert synopsis_flags(page) == flags(build_parser())  # tmt [-q/--quiet] COMMAND
    wrong = []
    for name, parser in subcommands().items():
        # the section by its heading, fences kept for the synopsis
        start = page.find(f"## `tmt {name}`\n")
        if f"tmt-{name}" not in anchors or start < 0:
            wrong.append(f"tmt {name} has no section")
            continue
        end = page.find("\n## ", start + 1)
        documented = synopsis_flags(page[start : end if end > 0 else None])
        if documented != flags(parser):
            wrong.append(
                f"tmt {name}: synopsis has {sorted(documented - flags(parser))} that the parser "
                f"lacks, lacks {sorted(flags(parser) - documented)}"
            )
    assert not wrong, wrong


def test_every_flag_is_described_outside_the_synopses():
    described = prose(read(DOCS / "commands.md"))
    missing = [
        f"tmt {name} {flag}"
        for name, parser in subcommands().items()
        for flag in sorted(flags(parser))
        if flag.startswith("--") and not re.search(rf"`{re.escape(flag)}[` ]", described)
    ]
    assert not missing, f"flags not described in docs/commands.md: {missing}"


# --------------------------------------------------------------------------- serving


def test_the_serving_flags_table_gives_the_parsers_flags_and_defaults():
    serve = subcommands()["serve"]
    shared = flags(subcommands()["translate"]) | {"-h"}  # described in commands.md
    own = {
        a.option_strings[0]: a.default
        for a in serve._actions
        if a.option_strings and a.option_strings[0] not in shared
    }
    rows = table_rows(sections(read(DOCS / "serving.md"))["flags"])
    table = {row[0].strip("`").split()[0]: row[1] for row in rows}
    assert set(table) == set(own), (sorted(table), sorted(own))
    wrong = [
        f"{flag}: page {table[flag]!r}, parser {default!r}"
        for flag, default in own.items()
        if default is not None and literal(table[flag]) != default
    ]
    assert not wrong, wrong


def test_the_serving_prose_states_the_codes_limits():
    """Issue 22, item 20: the docs promised a batch bound that the code did not keep."""
    from transformer_mt.serve import Limits

    page, d = read(DOCS / "serving.md"), Limits()
    for claim in (
        f"`--batch-wait` seconds,\n{d.batch_wait:g} by default",
        f"`--batch-lines` lines, {d.batch_lines}",
        f"`--batch-work` decoding steps, {d.batch_work:,}",
        f"`--max-body` ({d.max_body:,} bytes)",
        f"`--max-lines` ({d.max_lines})",
        f"`--max-work` ({d.max_work:,} steps)",
        f"`--max-queue` ({d.max_queue})",
        f"`--deadline` ({d.deadline:g} s)",
    ):
        assert claim in page, claim


# --------------------------------------------------------------------------- the demo


def test_the_demo_page_states_the_demo_configs_budget():
    """Issue 22, item 20: the README promised a demo budget that the code did not keep."""
    demo = load_config(ROOT / "configs" / "demo.yaml").train
    page = sections(read(DOCS / "training.md"))["the-demo"]
    assert f"`train.max_minutes: {demo.max_minutes:g}`" in page
    assert f"{demo.max_steps} updates of {demo.max_tokens:,} tokens" in page
    assert f"over the last {demo.cooldown:.0%} of either" in page


def test_no_page_claims_a_decoding_row_that_the_bench_does_not_measure():
    bench = read(ROOT / "scripts" / "bench_decode.py").lower()
    for page in PAGES:
        claims = re.findall(r"[^.]*\bdecod[^.]*JoeyNMT[^.]*", prose(read(page)))
        assert "joey" in bench or not claims, f"{page.name} says JoeyNMT decoding is measured"


# --------------------------------------------------------------------------- the module map


def package_imports(path: Path) -> set[str]:
    """The package modules a module imports, at the top or inside functions."""
    modules = {p.stem for p in path.parent.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(read(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:  # from . import x: a module, or a name of the package's __init__
                found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found |= {n.split(".")[1] for n in names if n.startswith("transformer_mt.")}
    return found & modules


def test_the_module_map_lists_every_module_below_what_it_imports():
    """docs/modules.md: each module imports only modules listed above it (item 8)."""
    package = ROOT / "transformer_mt"
    diagram = FENCE.search(read(DOCS / "modules.md"))[0].splitlines()[1:-1]
    rank = {}
    for i, line in enumerate(diagram):  # "name.py[, other.py]  what it holds"; indented: more
        rank |= {name: i for name in re.findall(r"(\w+)\.py", re.split(r"\s{2,}", line)[0])}
    modules = {p.stem for p in package.glob("*.py")} - {"__init__", "__main__"}
    assert modules <= set(rank), f"missing from docs/modules.md: {sorted(modules - set(rank))}"
    assert set(rank) <= modules, f"no such module: {sorted(set(rank) - modules)}"
    upward = [
        f"{m} imports {other}"
        for m in sorted(modules)
        for other in package_imports(package / f"{m}.py") - {"__init__", "__main__"}
        if rank[other] >= rank[m] and other != m
    ]
    assert not upward, f"docs/modules.md lists these the wrong way round: {upward}"

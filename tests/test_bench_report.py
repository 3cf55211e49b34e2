"""The benchmarks' one report helper: a section of BENCHMARKS.md is replaced in place, the others
are kept, and tables come out as markdown."""

from scripts.benchlib import HEADER, md_table, write_section


def test_a_section_is_added_then_replaced_in_place_and_the_others_are_kept(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    write_section(path, "speed", "## Speed", "old figures")
    write_section(path, "quality", "## Quality", None, "", "a paragraph")
    write_section(path, "speed", "## Speed", "new figures")
    doc = path.read_text()
    assert doc.startswith(HEADER)
    assert "old figures" not in doc and doc.count("<!-- speed:start -->") == 1
    # the replaced section stays where it was, before the one added after it
    assert doc.index("new figures") < doc.index("## Quality")
    # empty blocks are left out: one blank line between the others
    assert "<!-- quality:start -->\n## Quality\n\na paragraph\n<!-- quality:end -->\n" in doc


def test_a_table_aligns_the_columns_it_is_told_to_and_leaves_empty_cells_empty():
    table = md_table(["name", "tok/s", "note"], [("ours", "1,902", ""), ("peer", 514, "x")], "lr")
    assert table.splitlines() == [
        "| name | tok/s | note |",
        "| --- | ---: | --- |",
        "| ours | 1,902 | |",
        "| peer | 514 | x |",
    ]

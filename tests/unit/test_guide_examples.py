"""README.md and the user guide (docs/guide/) stay true: every Python example says how it
runs and compiles, the pure-Python ones run here, links point at pages and headings that
exist, and the command-line page names every flag. The examples that need a live
service run in tests/integration/test_guide_examples.py."""

from __future__ import annotations

import re

import pytest

from ..doc_examples import (
    GUIDE,
    KINDS,
    PAGES,
    ROOT,
    all_examples,
    headings,
    links,
    pages_with,
    run_page,
)

README_MAX_LINES = 200  # issue 39: a README a newcomer reads in five minutes


def test_every_python_example_says_how_it_runs():
    unmarked = [
        f"{e.where} ({e.kind or 'no marker'})" for e in all_examples() if e.kind not in KINDS
    ]
    assert not unmarked, (
        f"python blocks without a known '<!-- example: KIND -->' line before them: {unmarked}; "
        f"KIND is one of {KINDS} (tests/doc_examples.py), or fence the block ```text"
    )


@pytest.mark.parametrize("example", all_examples(), ids=lambda e: e.where)
def test_every_python_example_compiles(example):
    example.compiled()


def test_one_launch_example_in_the_readme_and_a_teardown_after_it():
    launches = all_examples("launch")
    assert [e.page.name for e in launches] == ["README.md"], [e.where for e in launches]
    teardowns = all_examples("teardown")
    assert teardowns and all(e.page.name == "README.md" for e in teardowns)
    assert "svc = " in launches[0].code, "the guide's service examples use `svc`"


def test_examples_use_public_names_only():
    # Internal modules move (engine/ and weight_sync/ are being split); the examples
    # import from the top-level package and torchrl_vllm_ext.testing only.
    internal = re.compile(r"torchrl_vllm_ext\.(?!testing\b)\w+")
    found = [e.where for e in all_examples() if e.kind != "shown" and internal.search(e.code)]
    assert not found, f"examples importing internal modules: {found}"


@pytest.mark.parametrize("page", pages_with("unit"), ids=lambda p: p.name)
def test_pure_python_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHRL_VLLM_CACHE", str(tmp_path / "cache"))
    run_page(page, "unit", {"__name__": "__guide__"})


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_point_at_files_and_headings_that_exist(page):
    broken = []
    for target, path, anchor in links(page):
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in headings(path):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path.name}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_readme_links_every_guide_page_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in GUIDE.glob("*.md") if f"(docs/guide/{p.name})" not in readme]
    assert not missing, f"guide pages the README does not link: {missing}"
    lines = len(readme.splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/guide/"


def test_the_command_line_page_names_every_flag():
    from torchrl_vllm_ext.cli import build_parser

    text = (GUIDE / "cli.md").read_text()
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    missing = []
    for name, sub in commands.items():
        assert f"torchrl-vllm {name}" in text, f"cli.md has no section on `torchrl-vllm {name}`"
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help") and not re.search(
                    rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text
                ):
                    missing.append(f"{name} {flag}")
    assert not missing, f"flags docs/guide/cli.md does not name: {missing}"

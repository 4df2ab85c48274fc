"""docs/models.md's support table is the rendering of the family matrix's recorded results
(docs/models.json), and every row of the matrix is in it."""

from __future__ import annotations

from pathlib import Path

from torchrl_vllm_ext.jobs.support_table import (
    COLUMNS,
    TABLE_END,
    TABLE_START,
    load_results,
    render_table,
    replace_table,
)

from ..helpers import FAMILY_MATRIX

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_committed_table_is_the_rendering_of_the_recorded_results():
    results = load_results(DOCS / "models.json")
    document = (DOCS / "models.md").read_text()
    assert replace_table(document, render_table(results)) == document


def test_every_family_of_the_matrix_has_a_row_with_every_check():
    results = {r["family"]: r for r in load_results(DOCS / "models.json")}
    assert list(results) == list(FAMILY_MATRIX)
    for row, result in results.items():
        checks = result["checks"]
        assert {c for names in COLUMNS.values() for c in names} <= set(checks), row
        for name, check in checks.items():
            # A cell is "yes" only for a test that passed, within the matrix's 1e-4 (bf16
            # replicas: within the value check's limit, recorded beside the gap).
            assert check["ok"] is True or check.get("engine"), (row, name, check)
            limit = check.get("limit") or 1e-4
            assert check["gap"] is None or check["gap"] <= limit, (row, name)


def test_replace_table_keeps_the_document_around_the_markers():
    doc = f"intro\n{TABLE_START}\nold\n{TABLE_END}\nend\n"
    assert replace_table(doc, "| t |") == f"intro\n{TABLE_START}\n| t |\n{TABLE_END}\nend\n"

"""The code examples of README.md and the user guide (docs/guide/), as the tests run them.

Every ```python block of those pages follows a marker line that says how it runs:

    <!-- example: unit -->          pure Python, no engine: tests/unit runs it
    <!-- example: launch -->        starts the service the ``service`` blocks use (README.md)
    <!-- example: service -->       needs that live service: tests/integration runs it
    <!-- example: teardown -->      stops that service, after the ``service`` blocks
    <!-- example: shown (why) -->   shown only (a GPU, a service of its own, ...): compiled

The blocks of one page run in order in one namespace; ``service`` blocks start from a copy
of the namespace the ``launch`` block left (``svc``, ``model_path``). Blocks that only
illustrate (a diff, a shell command) are fenced ```text or ``` and are not read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide"
PAGES = (ROOT / "README.md", *sorted(GUIDE.glob("*.md")))
"""The pages whose examples the tests run."""
KINDS = ("unit", "launch", "service", "teardown", "shown")
MARKER = re.compile(r"<!--\s*example:\s*(\w+)(.*?)-->")
FENCE = "```"


@dataclass(frozen=True)
class Example:
    """One ```python block of a page."""

    page: Path
    line: int
    """Line number of the block's first code line in the page (1-based)."""
    kind: str
    """A :data:`KINDS` entry, or the unknown word of its marker ("" without one)."""
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def compiled(self):
        # Padded so that a traceback names the page's own line numbers.
        return compile("\n" * (self.line - 1) + self.code, str(self.page), "exec")

    def run(self, namespace: dict) -> None:
        exec(self.compiled(), namespace)


def examples(page: Path) -> list[Example]:
    """The ```python blocks of ``page``, in order, with the marker before each."""
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith(FENCE):
            i += 1
            continue
        lang = lines[i][len(FENCE) :].strip()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(FENCE))
        if lang == "python":
            before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            marker = MARKER.fullmatch(before.strip())
            kind = marker.group(1) if marker else ""
            found.append(Example(page, i + 2, kind, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return found


def all_examples(kind: str | None = None) -> list[Example]:
    """Every page's examples (of ``kind`` only, if given)."""
    return [e for page in PAGES for e in examples(page) if kind is None or e.kind == kind]


def pages_with(kind: str) -> list[Path]:
    return [page for page in PAGES if any(e.kind == kind for e in examples(page))]


def run_page(page: Path, kind: str, namespace: dict) -> None:
    """Run the ``kind`` examples of ``page`` in order in ``namespace``."""
    for example in examples(page):
        if example.kind == kind:
            example.run(namespace)


# ---------------------------------------------------------------------------- links
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def headings(page: Path) -> set[str]:
    """GitHub's anchors of ``page``'s headings (outside code blocks)."""
    anchors, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith(FENCE):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def links(page: Path) -> list[tuple[str, Path, str]]:
    """(link, target file, anchor) of ``page``'s relative links outside code blocks."""
    prose, in_code = [], False
    for line in page.read_text().splitlines():
        if line.startswith(FENCE):
            in_code = not in_code
        elif not in_code:
            prose.append(line)
    found = []
    for target in LINK.findall(" ".join(prose)):  # a link's text may span two lines
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        found.append((target, (page.parent / path).resolve() if path else page, anchor))
    return found

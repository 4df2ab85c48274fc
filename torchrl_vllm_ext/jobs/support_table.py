"""The support table of ``docs/models.md``: results of the family matrix or of
``torchrl-vllm check-model``, rendered as markdown, one row per model.

A result is ``{"family" or "model", "architecture", "note"?, "checks": {name: {"ok",
"gap", "error", "engine"?}}}``; the matrix writes ``{"families": [result, ...]}``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from torchrl_vllm_ext.weight_sync.transports import registry

_STARTUP = re.compile(
    r"could not start vLLM on .*?: (?P<reason>.*?)(?: \(engine arguments: .*)?$", re.S
)


def engine_reason(error) -> str:
    """vLLM's own reason out of a :class:`ReplicaStartupError`'s message (the replica and
    the engine arguments left out); other messages unchanged.

    Examples:
        >>> engine_reason("replica 0 could not start vLLM on '/m': ValueError: GPT2LMHeadModel "
        ...               "does not support LoRA yet. (engine arguments: {'dtype': 'float32'})")
        'ValueError: GPT2LMHeadModel does not support LoRA yet.'
    """
    text = str(error)
    match = _STARTUP.search(text)
    return match.group("reason") if match else text


CHECKED = registry.names(cpu=True, composite=False)
"""The transports a row checks (check-model and the family matrix push with each)."""

COLUMNS = {  # header -> the checks of a row it sums up (all must pass)
    "serve": ("serve",),
    **{t: (t,) for t in CHECKED},
    "lora": ("lora",),
    "bad push refused": ("refuse_missing", "refuse_shape"),
    "bf16 trainer": ("cast",),
    "replay": ("replay",),
    "bf16 serve": ("bf16_serve",),
    **{f"bf16 {t}": (f"bf16_{t}",) for t in CHECKED},
    "bf16 lora": ("bf16_lora",),
    "bf16 trainer on bf16": ("bf16_cast",),
    "bf16 replay": ("bf16_replay",),
}
"""The table's check columns: float32 replicas, then (``bf16_*`` checks) bfloat16 ones. The
family matrix runs them all; ``check-model`` serve, storage, broadcast, lora (``--dtype
bfloat16``: their bf16 columns)."""
TABLE_START, TABLE_END = "<!-- support-table:start -->", "<!-- support-table:end -->"


def load_results(path: str | Path) -> list[dict]:
    """Results written by ``check-model`` (one, or a list) or by the family matrix."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = data.get("families", [data])
    return list(data)


def _cell(checks: list[dict]) -> str:
    if not checks:
        return "n/a"
    if any(c.get("engine") for c in checks):
        return "no (vLLM)"
    if any(c.get("ok") is False for c in checks):
        return "**no**"
    if any(c.get("ok") is None for c in checks):
        return "not run"
    paths = {c["path"] for c in checks if c.get("path")}
    if paths - {"replay"}:  # passed on the loader's own path (MoE: layerwise reload)
        return ", ".join(sorted(paths - {"replay"}))
    gaps = [c["gap"] for c in checks if c.get("gap") is not None]
    return f"yes ({max(gaps):.0e})" if gaps else "yes"


def render_table(results: list[dict]) -> str:
    """The support table (markdown) of ``results``: one row per model, a column per check
    (``yes (max |gap|)``; ``no (vLLM)``: the engine refused, its reason in the notes;
    ``**no**``: this package failed; ``n/a``: not asked; ``not run``; the replay columns:
    ``yes`` when pushes load by the workers' load plan, bitwise as the loader, else the
    path they load by, ``layerwise``), and the notes: the row's own, then every error.

    Examples:
        >>> row = {"family": "qwen3", "architecture": "Qwen3ForCausalLM",
        ...        "checks": {"serve": {"ok": True, "gap": 2e-7}}}
        >>> print(render_table([row]).splitlines()[2])
        | qwen3 | Qwen3ForCausalLM | yes (2e-07) | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |  |
    """
    headers = ["family", "architecture", *COLUMNS, "notes"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in results:
        checks = row.get("checks", {})
        notes = [row["note"]] if row.get("note") else []
        errors: dict[str, list[str]] = {}  # reason -> the checks it stopped
        for name, check in checks.items():
            if check.get("error"):
                errors.setdefault(engine_reason(check["error"]), []).append(name)
        notes += [f"{', '.join(names)}: {reason}" for reason, names in errors.items()]
        cells = [
            row.get("family") or Path(row.get("model", "?")).name,
            row.get("architecture", "?"),
            *(_cell([checks[n] for n in names if n in checks]) for names in COLUMNS.values()),
            "; ".join(_one_line(n) for n in notes),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replace_table(document: str, table: str) -> str:
    """``document`` with the text between its table markers replaced by ``table``."""
    start, end = document.find(TABLE_START), document.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"no {TABLE_START} ... {TABLE_END} markers in the document.")
    return document[: start + len(TABLE_START)] + "\n" + table + "\n" + document[end:]


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."

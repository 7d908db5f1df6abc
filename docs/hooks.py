"""mkdocs hooks: pages that read the code and the results instead of repeating them.

- reference/config.md: the configuration reference, from gw.config's sections (each field's
  name, type, default, help and the command line's flags);
- measurements.md: every file in benchmarks/results, read when the site is built (the numbers
  live in the JSON, not in prose), its plot shown beside it;
- every page: a figure quoted in prose is written `{{ result FILE KEY [OPS] [FORMAT] }}` and read
  from benchmarks/results/FILE when the site is built (a missing file or key fails the build), so
  no prose figure can outlive the result it quotes.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def on_files(files, config):
    """The results' plots and JSON files become part of the site, under results/."""
    for p in sorted(RESULTS.rglob("*")):
        if p.is_file() and p.suffix in (".png", ".json"):
            files.append(File(str(p.relative_to(RESULTS.parent)), str(RESULTS.parent), config["site_dir"],
                              config["use_directory_urls"]))
    return files


def config_reference() -> str:
    """One table a section, from its declaration (gw.config): field, flag, type, default, help."""
    from gridweave.config import SECTIONS

    out = []
    for section in SECTIONS:
        out += [f"### [{section.NAME}]", "", "| field | command line | type | default | notes |", "|---|---|---|---|---|"]
        for f in section.declared():
            note = f.metadata["help"]
            values = (f.metadata["cli"] or {}).get("choices", f.metadata["choices"])
            if values is not None:
                note += "; one of " + ", ".join(f"`{c}`" for c in values)
            flag = "--" + f.name.replace("_", "-")
            negative = ["--no-" + flag[2:]] if f.type == "bool" and f.default else []  # argparse's BooleanOptionalAction
            flags = ", ".join(f"`{x}`" for x in [flag, *negative, *(e for e, _ in f.metadata["flags"])])
            out.append(f"| `{f.name}` | {flags} | `{f.type}` | `{f.default!r}` | {note.replace('|', '&#124;')} |")
        out.append("")
    return "\n".join(out)


def _summary(value, depth=0) -> str:
    if isinstance(value, dict):
        keys = list(value)
        shown = ", ".join(f"`{k}`" for k in keys[:8])
        return f"{len(keys)} entries: {shown}{', ...' if len(keys) > 8 else ''}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"`{value!r}`"


def measurements() -> str:
    out = []
    for p in sorted(RESULTS.rglob("*.json")):
        rel = p.relative_to(RESULTS.parent)
        try:
            data = json.loads(p.read_text())
        except ValueError as e:
            raise ValueError(f"{rel} is not JSON: {e}") from None
        out.append(f"## {rel}\n")
        out.append(f"[the data]({rel}); {_summary(data)}\n")
        png = p.with_suffix(".png")
        if png.exists():
            out.append(f"![{p.stem}]({png.relative_to(RESULTS.parent)})\n")
        out.append("")
    return "\n".join(out)


def plan_columns() -> str:
    from gridweave.plan import TABLE_COLUMNS

    return "\n".join(["| column | what it is |", "|---|---|"] +
                     [f"| `{k}` | {v} |" for k, v in TABLE_COLUMNS.items()])


def config_sections() -> str:
    from gridweave.configfile import TABLES

    rows = ["| section | keys |", "|---|---|"]
    return "\n".join(rows + [f"| `[{name}]` | {', '.join(f'`{k}`' for k in keys)} |" for name, keys in TABLES.items()])


# {{ result FILE KEY [OPS...] [FORMAT] }}: KEY a dotted path into the JSON (list items by index,
# negative from the end); OPS median | mean | min | max | len | *X | /X | -X (X minus the value) |
# /@KEY | *@KEY | -@KEY (by another value of the same file: a ratio, a difference); FORMAT a format
# spec starting with "." or "," (e.g. .1f, .0%, ,.0f; none: str()).
RESULT = re.compile(r"\{\{\s*result\s+(\S+\.json)\s+(\S+)((?:\s+(?!\}\})\S+)*)\s*\}\}")
_REDUCE = {"median": statistics.median, "mean": statistics.fmean, "min": min, "max": max, "len": len}


def _lookup(doc, file: str, key: str):
    value = doc
    for part in key.split("."):
        try:
            value = value[int(part)] if isinstance(value, list) else value[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise KeyError(f"{{{{ result {file} {key} }}}}: {RESULTS / file} has no {part!r} there") from None
    return value


def result(file: str, key: str, ops=()) -> str:
    """One figure of a result file, as the docs quote it."""
    doc = json.loads((RESULTS / file).read_text())
    value = _lookup(doc, file, key)
    spec = ""
    for op in ops:
        if op in _REDUCE:
            value = _REDUCE[op](value)
        elif op[0] in "*/-" and len(op) > 1:
            x = _lookup(doc, file, op[2:]) if op[1] == "@" else float(op[1:])
            value = value * x if op[0] == "*" else value / x if op[0] == "/" else \
                (value - x if op[1] == "@" else x - value)
        elif op[0] in ".,":
            spec = op
        else:
            raise ValueError(f"{{{{ result {file} {key} }}}}: unknown operation {op!r}")
    return format(value, spec) if spec else str(value)


def results_in(markdown: str) -> str:
    return RESULT.sub(lambda m: result(m.group(1), m.group(2), m.group(3).split()), markdown)


MARKERS = {"<!-- config-reference -->": config_reference, "<!-- measurements -->": measurements,
           "<!-- plan-columns -->": plan_columns, "<!-- config-sections -->": config_sections}


def on_page_markdown(markdown, page, config, files):
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return results_in(markdown)

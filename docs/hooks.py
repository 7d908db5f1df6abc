"""mkdocs hooks: pages that read the code and the results instead of repeating them.

- reference/config.md: the configuration reference, from gw.train.TrainConfig's fields (names,
  types, defaults, the comments beside them) and the command line's flag for each;
- measurements.md: every file in benchmarks/results, read when the site is built (the numbers
  live in the JSON, not in prose), its plot shown beside it.
"""
from __future__ import annotations

import ast
import dataclasses
import json
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


def _field_comments(cls) -> dict:
    """The comment written beside each field of a dataclass's source (`name: type = default  # why`)."""
    path = Path(__import__(cls.__module__, fromlist=["_"]).__file__)
    source = path.read_text().split("\n")
    tree = ast.parse("\n".join(source))
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    line = source[stmt.lineno - 1]
                    out[stmt.target.id] = line.split("#", 1)[1].strip() if "#" in line else ""
    return out


def config_reference() -> str:
    from gridweave.train import CHOICES, TrainConfig

    comments = _field_comments(TrainConfig)
    rows = ["| field | command line | type | default | notes |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(TrainConfig):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else ""
        note = comments.get(f.name, "")
        if f.name in CHOICES:
            note = (note + "; " if note else "") + "one of " + ", ".join(f"`{c}`" for c in CHOICES[f.name])
        flag = "--" + f.name.replace("_", "-")
        rows.append(f"| `{f.name}` | `{flag}` | `{f.type}` | `{default!r}` | {note} |")
    return "\n".join(rows)


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
    from gridweave.configfile import LAUNCH, SECTIONS

    rows = ["| section | keys |", "|---|---|"]
    rows += [f"| `[{name}]` | {', '.join(f'`{k}`' for k in keys)} |" for name, keys in SECTIONS.items()]
    return "\n".join(rows + [f"| `[launch]` | {', '.join(f'`{k}`' for k in LAUNCH)} |"])


MARKERS = {"<!-- config-reference -->": config_reference, "<!-- measurements -->": measurements,
           "<!-- plan-columns -->": plan_columns, "<!-- config-sections -->": config_sections}


def on_page_markdown(markdown, page, config, files):
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown

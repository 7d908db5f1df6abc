"""The documentation reads its figures from the result files: every `{{ result FILE KEY ... }}`
placeholder resolves against benchmarks/results (a missing file or key fails) and renders the
value the JSON holds."""
import json
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT / "docs")) for p in PAGES])
def test_every_placeholder_resolves(page, docs_hooks):
    rendered = docs_hooks.results_in(page.read_text())
    assert "{{" not in rendered, [line for line in rendered.splitlines() if "{{" in line]


def test_a_placeholder_renders_what_the_json_holds(tmp_path, monkeypatch, docs_hooks):
    hooks = docs_hooks
    doc = {"tokens_per_s": [100.0, 300.0, 200.0], "val_loss": [[50, 4.5], [100, 3.25]], "a": 3.0, "b": 4.0}
    (tmp_path / "x.json").write_text(json.dumps(doc))
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    text = ("{{ result x.json tokens_per_s median /1e3 .1f }}k; {{ result x.json val_loss.-1.1 }}; "
            "{{ result x.json a /@b .0% }}; {{ result x.json a -@b }}; {{ result x.json tokens_per_s len }}")
    want = (f"{statistics.median(doc['tokens_per_s']) / 1e3:.1f}k; 3.25; {3 / 4:.0%}; -1.0; 3")
    assert hooks.results_in(text) == want
    for bad in ("{{ result x.json nothing }}", "{{ result x.json val_loss.7 }}", "{{ result y.json a }}",
                "{{ result x.json a sqrt }}"):
        with pytest.raises((KeyError, ValueError, OSError)):
            hooks.results_in(bad)

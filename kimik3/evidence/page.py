"""The evidence pages (docs/architecture.md §13): one HTML dossier per unit and an index with a row per unit, its
status coloured at a glance, each row linking to its dossier. Static files with inline styles: they open with no
server and load nothing from the network.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from kimik3.evidence.dossier import SECTIONS, short, status, to_markdown
from kimik3.util.files import atomic_write_text

__all__ = ["write_pages", "page_name", "COLOURS"]

COLOURS = {"proven": "#c8e6c9", "CPU-proven, GPU-unproven": "#fff3c4", "unproven": "#ffe0b2",
           "not recorded": "#e0e0e0", "stale": "#ffccbc", "untested": "#ffab91", "failing": "#ef9a9a"}
_STYLE = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:80em}table{border-collapse:collapse}"
          "td,th{border:1px solid #bbb;padding:.3em .5em;vertical-align:top;font-size:90%;text-align:left}"
          "td table td,td table th{font-size:100%}"
          "code,pre{font-size:85%}pre{white-space:pre-wrap}h2{margin-top:1.4em}")


def page_name(unit: str) -> str:
    """The dossier file of a unit (``megakernel/moe`` -> ``megakernel__moe.html``)."""
    return unit.replace("/", "__") + ".html"


def _cell(v: Any) -> str:
    """A value as HTML: a mapping as a nested table, a list of scalars inline, a list of mappings as a table."""
    if isinstance(v, dict):
        if not v:
            return "—"
        return "<table>" + "".join(f"<tr><th>{html.escape(str(k))}</th><td>{_cell(x)}</td></tr>"
                                   for k, x in v.items()) + "</table>"
    if isinstance(v, list):
        if not v:
            return "—"
        if all(isinstance(x, dict) for x in v):
            keys = list(dict.fromkeys(k for x in v for k in x))
            head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
            rows = "".join("<tr>" + "".join(f"<td>{_cell(x.get(k, ''))}</td>" for k in keys) + "</tr>" for x in v)
            return f"<table><tr>{head}</tr>{rows}</table>"
        return ", ".join(f"<code>{html.escape(str(x))}</code>" for x in v)
    if v is None:
        return "—"
    return html.escape(str(v))


def _section(name: str, body: Any) -> str:
    if name == "Validation":
        rows = "".join(
            f"<tr><td><code>{html.escape(t['test'])}</code></td><td>{html.escape(t['how'])}</td>"
            f"<td>{_cell(t.get('outcomes', 'not recorded'))}</td><td>{html.escape((t.get('commit') or '—')[:10])}"
            f"</td><td>{html.escape(t.get('date') or '—')}</td></tr>" for t in body["tests"]) or \
            "<tr><td colspan=5>no test reaches this unit</td></tr>"
        muts = "".join(f"<li>{html.escape(m['bug'])}: {html.escape(m['mutant'])} — <i>{html.escape(m['check'])}</i> "
                       f"(<code>{html.escape(m['test'])}</code>, last: {html.escape(m['last'])})</li>"
                       for m in body["mutants"]) or "<li>none planted in this unit's files</li>"
        return (f"<table><tr><th>test module</th><th>how it reaches the unit</th><th>last outcomes</th><th>commit</th>"
                f"<th>date</th></tr>{rows}</table><h3>Planted mutants</h3><ul>{muts}</ul>"
                f"<p>Stale: {body['stale']} (source hash <code>{body['source_hash'][:16]}</code>)</p>")
    if name == "Unproven":
        items = "".join(f"<li>{html.escape(x)}</li>" for x in body) or \
            "<li>nothing: every check this unit has ran green on its current source</li>"
        return f"<ul>{items}</ul>"
    return _cell(body)


def _dossier_html(d: dict[str, Any]) -> str:
    st = status(d)
    secs = "".join(f"<h2 id='{s.lower()}'>{s}</h2>{_section(s, d[s])}" for s in SECTIONS)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(d['unit'])}</title>"
            f"<style>{_STYLE}</style></head><body><p><a href='index.html'>all units</a></p>"
            f"<h1>{html.escape(d['unit'])} <small>({html.escape(d['kind'])})</small></h1>"
            f"<p>{html.escape(d['about'])}</p><p style='background:{COLOURS.get(st, '#fff')};padding:.4em'>"
            f"<b>Status:</b> {html.escape(st)}</p>{secs}</body></html>")


def _index_html(ds: list[dict[str, Any]], notes: list[str], meta: dict[str, Any]) -> str:
    rows = []
    for d in ds:
        st = status(d)
        v = d["Validation"]
        recorded = [t for t in v["tests"] if t.get("recorded")]
        last = max((t.get("date") or "" for t in recorded), default="")
        rows.append(
            f"<tr style='background:{COLOURS.get(st, '#fff')}'><td><a href='{page_name(d['unit'])}'>"
            f"{html.escape(d['unit'])}</a></td><td>{html.escape(d['kind'])}</td><td>{html.escape(st)}</td>"
            f"<td>{sum(f['lines'] for f in d['Scope']['files'])}</td><td>{len(v['tests'])}</td>"
            f"<td>{len(v['mutants'])}</td><td>{html.escape(last or '—')}</td>"
            f"<td>{html.escape(', '.join(short(x) for x in d['Unproven']) or '—')}</td></tr>")
    dirty = " (uncommitted changes)" if meta.get("dirty") else ""
    legend = " ".join(f"<span style='background:{c};padding:.2em .5em'>{html.escape(k)}</span>"
                      for k, c in COLOURS.items())
    note = "".join(f"<li>{html.escape(n)}</li>" for n in notes) or "<li>none</li>"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>kimik3 evidence</title>"
            f"<style>{_STYLE}</style></head><body><h1>Design and evidence, unit by unit</h1>"
            f"<p>Commit <code>{html.escape(str(meta.get('commit')))}</code>{dirty}"
            f", written {html.escape(meta.get('date', ''))}; test results from <code>runs/test-results.json</code> "
            f"({meta.get('recorded_tests', 0)} tests recorded).</p><p>{legend}</p>"
            f"<table><tr><th>unit</th><th>kind</th><th>status</th><th>lines</th><th>test modules</th>"
            f"<th>planted mutants</th><th>last run</th><th>unproven</th></tr>{''.join(rows)}</table>"
            f"<h2>Notes</h2><ul>{note}</ul></body></html>")


def write_pages(out: Path, ds: list[dict[str, Any]], notes: list[str], meta: dict[str, Any]) -> Path:
    """``out/index.html``, a dossier page (HTML and Markdown) per unit and ``evidence.json``; returns the index."""
    out.mkdir(parents=True, exist_ok=True)
    for d in ds:
        atomic_write_text(out / page_name(d["unit"]), _dossier_html(d))
        atomic_write_text(out / page_name(d["unit"]).replace(".html", ".md"), to_markdown(d))
    atomic_write_text(out / "evidence.json", json.dumps({"meta": meta, "notes": notes, "units": ds}, indent=1,
                                                        ensure_ascii=False, default=str))
    return atomic_write_text(out / "index.html", _index_html(ds, notes, meta))

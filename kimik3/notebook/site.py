"""A static site of the executed notebooks: ``runs/index.html`` linking each notebook's HTML export and figures.

Why: a run is worth sharing only if it opens anywhere — a workshop room without internet, a browser pointed at a
copied folder. Every page here loads nothing from the network: the notebook exports use a template without the
CDN scripts nbconvert's ``lab`` template adds (require.js, MathJax, mermaid, the widget embedder), their figures
carry the plotly.js the notebook embedded once (:mod:`kimik3.notebook.start`), and the standalone figure files embed
their own. Links are relative, so the folder opens from ``file://`` with no server. (LaTeX in markdown stays as
source without MathJax.)
"""

from __future__ import annotations

import datetime as _dt
import html
from pathlib import Path

from kimik3.notebook.start import cdn_references
from kimik3.util.files import atomic_write_text

__all__ = ["export_html", "write_site"]

# The lab template with every block that loads a script from a CDN emptied (nothing in these notebooks needs
# require.js or mermaid; widget views without saved state fall back to their text form).
_OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


def export_html(notebook: str | Path, out_html: str | Path | None = None) -> Path:
    """Export an executed notebook to one self-contained HTML page (default: next to it, ``.html``); raises
    ValueError if the page would still load anything from the network."""
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter

    notebook = Path(notebook)
    if not notebook.is_file():
        raise ValueError(f"no notebook at {notebook}")
    out = Path(out_html) if out_html is not None else notebook.with_suffix(".html")
    exporter = HTMLExporter(template_name="lab", template_file="kimik3_offline.html.j2",
                            extra_loaders=[jinja2.DictLoader({"kimik3_offline.html.j2": _OFFLINE_TEMPLATE})])
    body, _ = exporter.from_notebook_node(nbformat.read(notebook, as_version=4))
    refs = cdn_references(body)
    if refs:
        raise ValueError(f"{notebook.name}: the HTML export would load from the network: {refs[:3]}")
    atomic_write_text(out, body)
    return out


def _figures(folder: Path, skip: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.html") if p != skip)


def write_site(out_root: str | Path = "runs", executed: list[Path] | None = None) -> Path:
    """Export every executed notebook under ``out_root`` (``<stem>/<stem>.ipynb``, or the given paths) to HTML and
    write ``out_root/index.html`` linking each export and its figure files; returns the index path."""
    root = Path(out_root)
    notebooks = sorted(executed) if executed is not None else sorted(
        p for p in root.glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb") if p.parent.name == p.stem)
    items = []
    for nb in notebooks:
        page = export_html(nb)
        figs = _figures(nb.parent, page)
        rel = lambda p: html.escape(p.relative_to(root).as_posix(), quote=True)  # noqa: E731 - relative: file:// works
        fig_links = "".join(f'<li><a href="{rel(f)}">{html.escape(f.stem.replace("_", " "))}</a></li>' for f in figs)
        items.append(f'<section><h2><a href="{rel(page)}">{html.escape(nb.stem.replace("_", " "))}</a></h2>'
                     f'<p>executed notebook · {len(figs)} figure file(s)</p><ul>{fig_links}</ul></section>')
    evidence = root / "evidence" / "index.html"
    if evidence.is_file():  # written beside the notebooks by run-notebooks (kimik3.evidence)
        items.insert(0, '<section><h2><a href="evidence/index.html">evidence: a dossier per unit</a></h2><p>scope, '
                        'contract, launch, numerics, validation, performance and what is unproven, for every kernel, '
                        'opcode family, stage and contract</p></section>')
    stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>kimik3: executed notebooks</title>
<style>body{{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}}
section{{border-top:1px solid #ddd;padding:.5rem 0}} h2{{font-size:1.2rem;margin:.4rem 0}} li{{margin:.1rem 0}}
p{{color:#555;margin:.2rem 0}}</style></head>
<body><h1>kimik3: executed notebooks</h1>
<p>Written {stamp} by <code>python -m kimik3 run-notebooks</code>. Every page opens offline (no server, no
network): plotly.js is embedded in each page.</p>
{"".join(items) or "<p>no executed notebooks found</p>"}
</body></html>
"""
    return atomic_write_text(root / "index.html", page)

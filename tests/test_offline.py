"""Offline and shareable: no notebook, executed output or exported page loads anything from the network, plotly.js
is embedded once per notebook, and `run-notebooks` writes a static site that opens from file://."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from kimik3.notebook.runner import NOTEBOOK_DIR, run_notebook
from kimik3.notebook.site import export_html, write_site
from kimik3.notebook.start import OFFLINE_RENDERER, cdn_references, setup_notebook

REPO = Path(__file__).resolve().parents[1]


def test_cdn_references_catches_what_loads_and_ignores_what_does_not():
    for planted in ('<script src="https://cdn.plot.ly/plotly-3.0.1.min.js"></script>',
                    '<script type="module">import "https://cdn.plot.ly/plotly-3.0.1.min"</script>',
                    '"<script src=\\"https://cdnjs.cloudflare.com/ajax/libs/mathjax/3.2.2/es5/tex-svg.min.js\\">',
                    'await import("https://cdnjs.cloudflare.com/ajax/libs/mermaid/11/mermaid.esm.min.mjs")',
                    'pio.renderers.default = "plotly_mimetype+notebook_connected"'):
        assert cdn_references(planted), planted
    # a URL that is only a string (plotly.js's own map-tile default), a link a reader may click: nothing loads
    assert cdn_references('dflt:"https://cdn.plot.ly/un/"; <a href="https://example.org">x</a>') == []
    with pytest.raises(ValueError, match="network"):
        setup_notebook("plotly_mimetype+notebook_connected")


def test_committed_notebooks_and_library_reference_no_cdn():
    sources = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.*")) + sorted((REPO / "kimik3").glob("*.py"))
    assert any(p.suffix == ".ipynb" for p in sources)
    for p in sources:
        if p.name == "nbsetup.py":  # it names the patterns it refuses
            continue
        assert cdn_references(p.read_text()) == [], p.name
        assert not re.search(r"include_plotlyjs\s*=\s*[\"']cdn", p.read_text()), p.name


def _plotlyjs_marker() -> str:
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    return js[len(js) // 2:len(js) // 2 + 200]  # a stretch of the bundle: present once per embedded copy


def test_executed_notebook_embeds_plotlyjs_once_and_the_site_opens_offline(tmp_path):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                           "display_name": "Python 3"}})
    nb.cells = [nbformat.v4.new_code_cell('out_dir = "unused"', metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("import plotly.graph_objects as go\nfrom pathlib import Path\n"
                                          "from kimik3.notebook.start import setup_notebook\n"
                                          "from kimik3.perf.roofline import save_html\nsetup_notebook()"),
                nbformat.v4.new_code_cell("fig = go.Figure(go.Scatter(y=[1, 3, 2]))\nfig.show()\n"
                                          "save_html(fig, Path(out_dir) / 'line.html')"),
                nbformat.v4.new_code_cell("go.Figure(go.Bar(y=[2, 1])).show()")]
    src = tmp_path / "src" / "00_offline.ipynb"
    src.parent.mkdir()
    nbformat.write(nb, src)
    out_root = tmp_path / "runs"
    executed = run_notebook(src, out_root, timeout=300)
    text = executed.read_text()
    assert cdn_references(text) == []
    outputs = [o for c in json.loads(text)["cells"] for o in c.get("outputs", [])]
    html_out = "".join("".join(o.get("data", {}).get("text/html", "")) for o in outputs)
    assert html_out.count(_plotlyjs_marker()) == 1  # embedded once, for every figure of the notebook
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figures) == 2 and all("text/html" in o["data"] for o in figures)  # JupyterLab and HTML export
    index = write_site(out_root)
    page = index.read_text()
    assert 'href="00_offline/00_offline.html"' in page and 'href="00_offline/line.html"' in page
    exported = (out_root / "00_offline" / "00_offline.html").read_text()
    assert cdn_references(exported) == [] and exported.count(_plotlyjs_marker()) == 1
    assert cdn_references((out_root / "00_offline" / "line.html").read_text()) == []
    assert OFFLINE_RENDERER.startswith("plotly_mimetype+")


def test_export_refuses_a_notebook_that_would_load_from_the_network(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x", outputs=[nbformat.v4.new_output(
        "display_data", data={"text/html": '<script src="https://cdn.plot.ly/plotly-3.0.1.min.js"></script>'})])]
    p = tmp_path / "n.ipynb"
    nbformat.write(nb, p)
    with pytest.raises(ValueError, match="network"):
        export_html(p)
    with pytest.raises(ValueError, match="no notebook"):
        export_html(tmp_path / "missing.ipynb")

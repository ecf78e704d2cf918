"""Set-up every notebook calls first: figures that render with no network, in JupyterLab and in exported HTML.

Why: plotly's ``notebook_connected`` renderer loads plotly.js from a CDN, so a workshop room without internet, or
an HTML export opened later, shows empty figures. :data:`OFFLINE_RENDERER` sends each figure twice in one output:
as plotly's JSON mimetype (JupyterLab draws it with the plotly extension, which ships its own plotly.js) and as
HTML that calls a plotly.js embedded once per notebook, at the first figure (what an nbconvert HTML export draws).
Standalone figure files are written with plotly.js inside (:func:`kimik3.perf.roofline.save_html`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

__all__ = ["CDN_PATTERNS", "OFFLINE_RENDERER", "NotebookEnv", "cdn_references", "setup_notebook", "start_notebook"]

OFFLINE_RENDERER = "plotly_mimetype+kimik3_offline"

# What makes a page load something from the network: a script, stylesheet or module import with an http(s) URL,
# or plotly's connected renderer. (URLs that are mere strings inside plotly.js, e.g. its map-tile defaults, load
# nothing for these figures and are not matched.)
CDN_PATTERNS = (r"<script[^>]*\ssrc=\\?[\"']https?://", r"<link[^>]*\shref=\\?[\"']https?://",
                r"import\(\s*\\?[\"']https?://", r"import\s+\\?[\"']https?://", r"cdn\.plot\.ly/plotly",
                r"notebook_connected")
_CDN_RE = re.compile("|".join(CDN_PATTERNS), re.IGNORECASE)
_MATHJAX_TAG = re.compile(r"<script[^>]*\ssrc=[\"']https?://[^\"']*mathjax[^\"']*[\"'][^>]*>\s*</script>",
                          re.IGNORECASE)


def _register() -> None:
    """Register ``kimik3_offline``: plotly's ``notebook`` renderer (plotly.js embedded once per notebook) without
    the MathJax ``<script src=https://...>`` tag plotly adds to every figure (our figures use no LaTeX)."""
    import plotly.io as pio
    from plotly.io._base_renderers import NotebookRenderer

    class OfflineNotebookRenderer(NotebookRenderer):
        def to_mimebundle(self, fig_dict):
            bundle = super().to_mimebundle(fig_dict)
            bundle["text/html"] = _MATHJAX_TAG.sub("", bundle["text/html"])
            return bundle

    if "kimik3_offline" not in pio.renderers:
        pio.renderers["kimik3_offline"] = OfflineNotebookRenderer()


def setup_notebook(renderer: str = OFFLINE_RENDERER) -> str:
    """Make plotly render offline in this kernel (``renderer``: a plotly renderer name; the default embeds
    plotly.js once, at the first figure shown, and JupyterLab draws the JSON mimetype with its own plotly.js).
    Returns the renderer set."""
    import plotly.io as pio

    if "connected" in renderer or "cdn" in renderer:
        raise ValueError(f"renderer {renderer!r} loads plotly.js from the network; use {OFFLINE_RENDERER!r}")
    _register()
    pio.renderers.default = renderer
    return renderer


class NotebookEnv(NamedTuple):
    """What a notebook's first code cell needs: where its figures go, the device it runs on and the dtype used
    there (a tuple, so ``out, dev, dtype = start_notebook(...)`` reads like the lines it replaces)."""

    out: Path
    device: str
    dtype: torch.dtype


def start_notebook(out_dir: str | Path, device: str = "auto", *, pandas_display: Mapping[str, object] | None = None,
                   renderer: str = OFFLINE_RENDERER) -> NotebookEnv:
    """The set-up every notebook repeats, in one call, so the notebooks agree on it: plotly renders offline
    (:func:`setup_notebook`), ``out_dir`` exists (figures are written there), pandas shows wide tables
    (``pandas_display``: option names under ``display.``, e.g. ``{"width": 200, "max_columns": 30}``; tables are
    the notebooks' main output and the default 80-column wrapping makes them unreadable), and ``device`` is resolved
    ("auto": the GPU when one is present, else the CPU). The dtype is bfloat16 on a GPU, where decode is measured as
    it would be served, and float32 on a CPU, which has no fast bf16 matmul and where the notebooks check
    correctness."""
    import pandas as pd
    import torch

    if not isinstance(device, str) or not device:
        raise ValueError(f"device must be 'auto' or a torch device name such as 'cpu' or 'cuda', got {device!r}")
    if device == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        try:
            torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"device {device!r} is not 'auto' or a torch device name ({e})") from None
        dev = device
    options = {f"display.{k}": v for k, v in (pandas_display or {}).items()}
    for name in options:
        try:
            pd.get_option(name)
        except (KeyError, AttributeError) as e:  # pandas' OptionError: an unknown option name
            raise ValueError(f"pandas_display: {name!r} is not a pandas option ({e})") from None
    setup_notebook(renderer)
    for name, value in options.items():
        pd.set_option(name, value)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if torch.device(dev).type == "cuda" else torch.float32
    return NotebookEnv(out, dev, dtype)


def cdn_references(text: str) -> list[str]:
    """Every network reference in ``text`` (a notebook, an output, an HTML page) that an offline page would try
    to load, each with a little context; empty when the page is self-contained."""
    return [text[max(0, m.start() - 40):m.end() + 40] for m in _CDN_RE.finditer(text)]

"""Seen in a real browser: JupyterLab (headless, loopback, no token) and Debian's Chromium, driven by Selenium.

* every plotly figure of the executed notebooks renders in JupyterLab (an SVG with a size, per figure output),
  and in their static HTML exports opened from ``file://`` (the offline site ``run-notebooks`` writes);
* a widget panel on a live kernel: changing one control (the preset dropdown) changes the figure;
* screenshots of every figure and of the interaction go to ``runs/browser/``.

By default the test executes notebook 02 with the CI parameters (it has figures and the live panel); with
``KIMIK3_BROWSER_RUNS=runs`` it checks every notebook already executed there by ``make run`` instead. Nothing is
downloaded: the browser is the system's (``apt-get install chromium chromium-driver``) and it runs with networking
features off. Under ``CI=true`` a missing prerequisite fails the test; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
SHOTS = REPO / "runs" / "browser"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
# networking features off, a fresh profile: this network refuses outside connections, and nothing may be fetched
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1400,1000"]

pytestmark = pytest.mark.timeout(600)


def _unavailable() -> str | None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install -y chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed (pip install selenium)"
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        return "jupyterlab is not installed"
    return None


def _require_browser() -> None:
    why = _unavailable()
    if why is None:
        return
    if os.environ.get("CI", "").lower() == "true":  # in CI the browser is installed: its absence is a failure
        pytest.fail(f"browser test cannot run under CI=true: {why}")
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _figure_count(nb: Path) -> int:
    cells = json.loads(nb.read_text())["cells"]
    return sum(PLOTLY_MIME in o.get("data", {}) for c in cells for o in c.get("outputs", []))


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> list[Path]:
    """Executed notebooks to check: those of ``$KIMIK3_BROWSER_RUNS`` (after ``make run``), else notebook 02
    executed now with the CI parameters."""
    _require_browser()
    runs = os.environ.get("KIMIK3_BROWSER_RUNS")
    if runs:
        found = sorted(p for p in Path(runs).glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb") if p.parent.name == p.stem)
        if not found:
            raise ValueError(f"KIMIK3_BROWSER_RUNS={runs}: no executed notebooks there (run `make run` first)")
        return found
    from kimik3.notebook.runner import CI, NOTEBOOK_DIR, run_notebook

    out = tmp_path_factory.mktemp("runs")
    nb = next(NOTEBOOK_DIR.glob("02_*.ipynb"))
    return [run_notebook(nb, out, CI.get(nb.stem, {}), timeout=600)]


@pytest.fixture(scope="module")
def lab(tmp_path_factory, executed):
    """A JupyterLab server on a free loopback port, no token, serving a folder with copies of the executed
    notebooks and a live-widget notebook; yields (base URL, root folder)."""
    root = tmp_path_factory.mktemp("lab")
    for nb in executed:
        shutil.copy(nb, root / nb.name)
    import nbformat

    widget_nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                                  "display_name": "Python 3"}})
    widget_nb.cells = [nbformat.v4.new_code_cell(
        "from kimik3.perf.roofline import roofline_panel\n"
        "panel = roofline_panel(preset='micro', hardware='h200', batch_size=1, context_len=1024)\npanel")]
    nbformat.write(widget_nb, root / "widget_panel.ipynb")
    settings = root.parent / f"{root.name}-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # render every cell, not only those scrolled into view, so every figure output exists in the page
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port = _free_port()
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings.parents[1]),
           "JUPYTER_RUNTIME_DIR": str(root.parent / f"{root.name}-runtime"),
           "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    log = open(root.parent / f"{root.name}-lab.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
                             f"--port={port}", "--IdentityProvider.token=", "--ServerApp.password=",
                             f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
                             "--LabApp.news_url=", "--LabApp.check_for_updates_class="
                             "jupyterlab.NeverCheckForUpdate",
                             *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.flush()
                raise RuntimeError("JupyterLab did not start:\n" + Path(log.name).read_text()[-3000:])
            time.sleep(0.5)
        yield url, root
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory, lab):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager: never fetch a driver or browser
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in [*CHROME_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.set_page_load_timeout(120)
    SHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def _wait(driver, fn, timeout: float, what: str):
    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        try:
            last = fn(driver)
            if last:
                return last
        except Exception as e:  # the page is still being built
            last = e
        time.sleep(0.5)
    driver.save_screenshot(str(SHOTS / "timeout.png"))
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


_RENDERED_PLOTS = """
const plots = Array.from(document.querySelectorAll(arguments[0]));
return plots.filter(p => { const s = p.querySelector('svg.main-svg');
  const r = p.getBoundingClientRect(); return s && r.width > 50 && r.height > 50; }).length;"""


def _wait_plots(driver, selector: str, expected: int, timeout: float, what: str) -> int:
    """Wait until at least ``expected`` plots under ``selector`` have drawn an SVG of real size; their count."""
    return _wait(driver, lambda d: (lambda k: k if k >= expected else 0)(d.execute_script(_RENDERED_PLOTS, selector)),
                 timeout, what)


def _shoot_figures(driver, selector: str, prefix: str) -> int:
    from selenium.webdriver.common.by import By

    plots = driver.find_elements(By.CSS_SELECTOR, selector)
    for i, el in enumerate(plots):
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", el)
        el.screenshot(str(SHOTS / f"{prefix}-fig{i:02d}.png"))
    return len(plots)


def test_every_figure_renders_in_jupyterlab(lab, browser, executed):
    url, _ = lab
    for nb in executed:
        expected = _figure_count(nb)
        assert expected > 0, f"{nb.name} has no figure output to check"
        browser.get(f"{url}/lab/tree/{nb.name}?reset")  # ?reset: no tabs restored from before
        sel = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea .js-plotly-plot"
        n = _wait_plots(browser, sel, expected, 180, f"{expected} rendered plotly figures in {nb.name}")
        assert n == expected, f"{nb.name}: {n} figures rendered, {expected} in the notebook"
        browser.save_screenshot(str(SHOTS / f"lab-{nb.stem}.png"))
        assert _shoot_figures(browser, sel, f"lab-{nb.stem}") == expected


def test_every_figure_renders_in_the_offline_html_export(browser, executed, tmp_path):
    from kimik3.notebook.site import write_site

    site = tmp_path / "site"
    for nb in executed:
        (site / nb.stem).mkdir(parents=True)
        shutil.copy(nb, site / nb.stem / nb.name)
    index = write_site(site)
    browser.get(index.as_uri())
    assert "executed notebooks" in browser.title
    for nb in executed:
        expected = _figure_count(nb)
        browser.get((site / nb.stem / f"{nb.stem}.html").as_uri())
        n = _wait_plots(browser, ".js-plotly-plot", expected, 120, f"{expected} figures in {nb.stem}.html")
        assert n == expected
        browser.save_screenshot(str(SHOTS / f"html-{nb.stem}.png"))


def test_widget_control_changes_the_figure_on_a_live_kernel(lab, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    url, _ = lab
    browser.get(f"{url}/lab/tree/widget_panel.ipynb?reset")
    _wait(browser, lambda d: d.execute_script(
        "const a = window.jupyterapp; const w = a && a.shell.currentWidget;"
        "return !!(w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel"
        " && w.sessionContext.session.kernel.status === 'idle');"), 180, "the notebook's kernel to be idle")
    browser.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")
    here = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the widget notebook's tab, not others left open
    title_js = (f"const t = document.querySelector('{here} .jp-OutputArea .js-plotly-plot .gtitle');"
                "return t ? t.textContent : '';")
    before = _wait(browser, lambda d: d.execute_script(title_js), 240, "the panel's figure to render")
    assert before.startswith("micro"), before
    panel_fig = browser.find_element(By.CSS_SELECTOR, f"{here} .jp-OutputArea .js-plotly-plot")
    panel_fig.screenshot(str(SHOTS / "widget-before.png"))
    preset = next(s for s in browser.find_elements(By.CSS_SELECTOR, f"{here} .widget-dropdown select")
                  if "micro" in [o.text for o in Select(s).options] and Select(s).first_selected_option.text == "micro")
    Select(preset).select_by_visible_text("tiny")  # a change event -> the kernel recomputes -> the figure updates
    after = _wait(browser, lambda d: (lambda t: t if t != before else "")(d.execute_script(title_js)), 120,
                  "the figure to change after the control changed")
    assert after.startswith("tiny"), after
    browser.find_element(By.CSS_SELECTOR, f"{here} .jp-OutputArea .js-plotly-plot").screenshot(
        str(SHOTS / "widget-after.png"))
    browser.save_screenshot(str(SHOTS / "widget-panel.png"))


def test_evidence_page_links_every_unit_to_its_dossier_offline(browser, tmp_path):
    """The evidence page ``make run`` puts in its site: one row per unit, each linking to a dossier that loads from
    ``file://`` with all seven sections, and no page naming anything on the network."""
    from selenium.webdriver.common.by import By

    from kimik3.evidence.cli import build
    from kimik3.evidence.dossier import SECTIONS
    from kimik3.notebook.start import cdn_references

    ds, _, _ = build(tmp_path / "evidence")
    browser.get((tmp_path / "evidence" / "index.html").as_uri())
    assert "evidence" in browser.title
    browser.save_screenshot(str(SHOTS / "evidence-index.png"))
    rows = browser.find_elements(By.CSS_SELECTOR, "table tr td:first-child a")
    links = {a.text: a.get_attribute("href") for a in rows}
    assert set(links) == {d["unit"] for d in ds}, set(links) ^ {d["unit"] for d in ds}
    for unit, href in links.items():
        browser.get(href)
        assert browser.find_element(By.TAG_NAME, "h1").text.startswith(unit)
        ids = {h.get_attribute("id") for h in browser.find_elements(By.CSS_SELECTOR, "h2[id]")}
        assert ids == {s.lower() for s in SECTIONS}, (unit, ids)
        if unit == "megakernel/moe":
            browser.save_screenshot(str(SHOTS / "evidence-megakernel-moe.png"))
    for page in (tmp_path / "evidence").glob("*.html"):
        text = page.read_text()
        assert cdn_references(text) == [] and "http://" not in text and "https://" not in text, page.name

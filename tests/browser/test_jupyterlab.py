"""What a workshop participant sees: notebook 03 run from JupyterLab's UI in Chromium.

The server is ``make lab`` itself (its options, overrides and notebook copies), with its
``LAB_DIR`` inside this clone, under the git-ignored runs/. Notebook 03's copy differs from
the real one only in its ``parameters`` cell (tiny data, 16 px images), written before
``make lab`` starts, which must keep it. ``progress="auto"`` so the widget panel is chosen
by detection. Screenshots go to runs/browser-artifacts/ (or $DDPNB_BROWSER_ARTIFACTS).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from labdriver import (
    CHROMIUM,
    CHROMIUM_ARGS,
    INSTALL_HINT,
    REPO,
    VENV,
    Lab,
    alive,
    artifacts_dir,
    training_pids,
    with_parameters,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NB = "03_multi_node_ddp.ipynb"
NB_4 = "03_multi_node_ddp_4nodes.ipynb"
NB_HANG = "06_hang.ipynb"  # notebook 06's cells up to its pitfall 6, the hang, tiny
SMALL = dict(
    data_dir="data/tiny",
    baseline_dir="runs/baseline",  # absent: the notebook plots DDP alone
    image_size=16,
    batch_size=8,
    progress="auto",
)
VISIBLE = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook tab in front
INTERRUPT_LIMIT = 10.0  # seconds from the stop button until no training process is left

# The panel as the page shows it: node rows, bar fill, plot source, status line.
PANEL_JS = """scope => {
  const panel = document.querySelector(scope + ' .ddpnb-progress');
  if (!panel) return null;
  const fill = sel => {
    const bar = panel.querySelector(sel + ' .progress-bar');
    return bar ? bar.style.width : null;
  };
  const img = panel.querySelector('img.ddpnb-plot');
  const bar = document.querySelector('#jp-main-statusbar');
  return {
    kernel: bar ? bar.innerText : '',
    // Broken: shown, and done loading with no picture (an empty or failed source). A new
    // picture still decoding is not complete yet, and is not broken.
    broken: !!(img && img.offsetParent !== null && img.complete && img.naturalWidth === 0),
    rows: [...panel.querySelectorAll('.ddpnb-node')].map(e => e.innerText.trim()),
    epoch: fill('.ddpnb-epoch-bar'),
    step: fill('.ddpnb-step-bar'),
    plot: img && img.naturalWidth > 0 ? img.src : null,
    status: panel.querySelector('.ddpnb-status').innerText,
    hang: panel.querySelector('.ddpnb-hang').innerText.trim(),
  };
}"""

# Line breaks inside a word in each <pre> line of a cell's outputs ("train_one_epo|ch"), and
# how many lines wrapped at all: each character's box, compared with the one before it.
MIDWORD_JS = """cell => {
  const broken = [];
  let wraps = 0;
  for (const line of cell.querySelectorAll('.jp-OutputArea pre > span')) {
    const walker = document.createTreeWalker(line, NodeFilter.SHOW_TEXT);
    let prev = null, top = null;
    while (walker.nextNode()) {
      const node = walker.currentNode;
      for (let i = 0; i < node.length; i++) {
        const range = document.createRange();
        range.setStart(node, i);
        range.setEnd(node, i + 1);
        const box = range.getBoundingClientRect(), ch = node.data[i];
        if (box.width === 0) continue;
        if (prev !== null && box.top > top + 2) {
          wraps++;
          if (/\\w/.test(prev) && /\\w/.test(ch)) broken.push(line.innerText.slice(0, 60));
        }
        prev = ch;
        top = box.top;
      }
    }
  }
  return {broken, wraps};
}"""

# Execution prompts of the visible notebook's code cells: "[3]:", "[*]:" or "[ ]:".
PROMPTS_JS = f"""() => [...document.querySelectorAll('{VISIBLE} .jp-CodeCell .jp-InputArea-prompt')]
  .map(e => e.innerText.trim())"""


def _menu(page, top: str, *path: str) -> None:
    page.locator(".lm-MenuBar-item", has_text=re.compile(f"^{top}$")).click()
    for label in path:
        item = page.locator(
            ".lm-Menu:visible .lm-Menu-item",
            has=page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{label}$")),
        )
        item.click() if label == path[-1] else item.hover()


def _open(page, lab, name: str) -> None:
    """Open a notebook in the lab and wait for its kernel to be idle."""
    page.goto(f"{lab.url}/lab/tree/{name}?token={lab.token}")
    page.locator(f"{VISIBLE} .jp-Notebook").wait_for()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = [s["kernel"]["execution_state"] for s in lab.api("sessions") if s["path"] == name]
        if states == ["idle"]:
            return
        time.sleep(0.3)
    raise AssertionError(f"the kernel of {name} did not become idle: {lab.api('sessions')}")


def _states(panel: dict) -> set[str]:
    """The node states a panel shows, e.g. {"running"}; rows read 'node 0 running ranks ...'."""
    # A row being redrawn can read shorter for a frame: it shows no state then.
    return {(row.split() + ["", "", ""])[2] for row in panel["rows"]}


def _finished(page) -> bool:
    prompts = page.evaluate(PROMPTS_JS)
    return bool(prompts) and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts)


def _save(page, path: Path) -> dict:
    """Save the notebook from the UI (Ctrl+S) and return the file's JSON."""
    before = path.stat().st_mtime_ns
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 15
    while path.stat().st_mtime_ns == before:
        assert time.monotonic() < deadline, "Ctrl+S did not save the notebook"
        time.sleep(0.2)
    time.sleep(0.5)  # the server writes the file in one go, but let it finish
    return json.loads(path.read_text())


def _shot(page, name: str) -> None:
    panel = page.locator(f"{VISIBLE} .ddpnb-progress")
    if panel.count():
        panel.scroll_into_view_if_needed()
    page.screenshot(path=artifacts_dir() / name)


# WCAG contrast ratio of an element's text against the first opaque background behind it.
CONTRAST_JS = """el => {
  const lum = c => {
    const [r, g, b] = c.match(/[\\d.]+/g).slice(0, 3).map(Number).map(v => {
      v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  let bg = el, color;
  while (bg) {
    color = getComputedStyle(bg).backgroundColor;
    if (!/rgba\\(.*, 0\\)$/.test(color) && color !== 'transparent') break;
    bg = bg.parentElement;
  }
  const [a, b] = [lum(getComputedStyle(el).color), lum(color)].sort((x, y) => y - x);
  return (a + 0.05) / (b + 0.05);
}"""


# -- fixtures (here, not in a conftest.py: a second conftest module would shadow the
# `from conftest import ...` of the other test files) -------------------------------


def _git_status(*paths: Path | str) -> str:
    """``git status --porcelain`` of ``paths`` in this clone: what a participant's pull sees."""
    args = ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=all", "--"]
    return subprocess.run([*args, *map(str, paths)], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def lab_root(tiny_data) -> Path:
    """make lab's LAB_DIR in this clone: the tiny dataset and notebook 03 with small
    parameters, there before make lab starts (a participant's own copy); the rest it copies."""
    root = REPO / "runs" / "browser-workshop"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(tiny_data, root / "data" / "tiny")
    with_parameters(REPO / "notebooks" / NB, root / NB, run_dir="runs/ddp", epochs=6, **SMALL)
    return root


@pytest.fixture(scope="module")
def lab(lab_root, tmp_path_factory):
    """``make lab`` on ``lab_root``; always shut down, leftovers killed by PID.

    ``lab.notebooks_status`` is git's view of notebooks/ before the server started."""
    notebooks_status = _git_status("notebooks")
    server = Lab(lab_root, tmp_path_factory.mktemp("lab-home"))
    server.notebooks_status = notebooks_status
    try:
        yield server
    finally:
        try:
            server.shutdown()
        finally:
            server.kill_leftovers()


@pytest.fixture(scope="module")
def page(lab):
    """A headless Chromium tab (1400x1000) logged in to ``lab``."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing. {INSTALL_HINT}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(f"playwright is not importable. {INSTALL_HINT}")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            tab = browser.new_page(viewport={"width": 1400, "height": 1000})
            tab.set_default_timeout(30_000)
            yield tab
        finally:
            browser.close()


# -- tests ---------------------------------------------------------------------------


def test_make_lab_serves_copies_and_keeps_the_participants_own(lab):
    originals = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in lab.root.glob("*.ipynb")) == originals
    for name in originals:  # copied as they are, except the copy that was already there
        same = (lab.root / name).read_bytes() == (REPO / "notebooks" / name).read_bytes()
        assert same == (name != NB), name
    assert "epochs = 6" in (lab.root / NB).read_text()  # not overwritten by make lab
    overrides = json.loads((VENV / "share/jupyter/lab/settings/overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    assert not _git_status(lab.root), "make lab's LAB_DIR must be git-ignored"


def test_run_all_shows_live_panel_plot_and_final_curves(lab, page):
    """About 60 s: notebook 03 run whole in JupyterLab in Chromium, as a participant does;
    the live panel is checked while the run trains, so the run must last a few epochs."""
    _open(page, lab, NB)
    _menu(page, "Run", "Run All Cells")

    samples, running_shot = [], False
    deadline = time.monotonic() + 150
    while not _finished(page):
        assert time.monotonic() < deadline, f"Run All did not finish: {samples[-1:]}"
        state = page.evaluate(PANEL_JS, VISIBLE)
        if state:
            samples.append(state)
            if not running_shot and state["plot"] and _states(state) == {"running"}:
                _shot(page, "03-running.png")
                running_shot = True
        time.sleep(0.1)
    final = page.evaluate(PANEL_JS, VISIBLE)
    _shot(page, "03-finished.png")

    assert final is not None, "the ipywidgets panel never rendered (progress='auto')"
    assert len(final["rows"]) == 2, final["rows"]
    assert all(row.split()[2] == "done" for row in final["rows"]), final["rows"]
    assert "master" in final["rows"][0]
    assert final["epoch"] == final["step"] == "100%", final
    assert "finished" in final["status"]
    running = [s for s in samples if _states(s) == {"running"}]
    idle = [s["kernel"] for s in running if "| Busy" not in s["kernel"]]
    assert running and not idle, f"the status bar read {idle[:3]} while the nodes trained"
    assert not [s for s in samples if s["broken"]], "a broken image showed in the panel"
    while_running = {s["plot"] for s in samples if s["plot"] and _states(s) == {"running"}}
    assert len(while_running) >= 2, f"the live plot changed {len(while_running)} time(s)"
    print(f"live plot redrawn {len(while_running)} times while the nodes were running")
    assert running_shot

    # The DDP curves cell shows its figure, and no cell shows an error.
    curves = page.locator(
        f"{VISIBLE} .jp-CodeCell",
        has=page.locator(".jp-InputArea", has_text="ddpnb.plot_curves("),
    ).locator(".jp-OutputArea img")
    assert curves.count() == 1 and curves.evaluate("img => img.naturalWidth") > 300
    curves.scroll_into_view_if_needed()
    page.screenshot(path=artifacts_dir() / "03-curves.png")
    saved = _save(page, lab.root / NB)
    outputs = [o for c in saved["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    # make lab's overrides: JupyterLab never asked about its news over the notebook.
    assert page.get_by_text("official Jupyter news").count() == 0
    # Run All, the widget state and Ctrl+S went to the copy: the clone is as it was.
    assert _git_status("notebooks") == lab.notebooks_status
    assert not _git_status(lab.root)


def _hang_notebook(dst: Path) -> Path:
    """Notebook 06's parameters, set-up and pitfall 6 cells (the hang), on the tiny data."""
    import nbformat

    nb = nbformat.read(REPO / "notebooks" / "06_pitfalls.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    setup = [c for c in code if c.source.startswith(("%matplotlib", "world_size ="))]
    launch_cfg = next(c for c in code if c.source.startswith("cfg = ddpnb.TrainConfig("))
    launch_cfg.source = launch_cfg.source.split("\ncorrect = ")[0]  # the config, not its run
    hang = next(c for c in code if c.source.startswith("hang_script = "))
    nb.cells = [code[0], *setup, launch_cfg, hang]
    nbformat.write(nb, dst)
    tiny = dict(train_images=60, val_images=37, image_size=16, batch_size=8, hang_timeout=12)
    return with_parameters(dst, dst, data_dir="data/tiny", run_root="runs/hang", **tiny)


def test_the_hang_reads_waiting_then_is_said_once_with_its_stacks_unbroken(lab, page):
    """Notebook 06's hang in the panel: the nodes read "waiting" before the verdict; the
    verdict's paragraph shows once (e.stacks); the stack column breaks no word."""
    _hang_notebook(lab.root / NB_HANG)
    page.set_viewport_size({"width": 1100, "height": 1000})  # a stack column that must wrap
    try:
        _open(page, lab, NB_HANG)
        _menu(page, "Run", "Run All Cells")
        samples, shot, deadline = [], False, time.monotonic() + 150
        while not _finished(page):
            assert time.monotonic() < deadline, f"Run All did not finish: {samples[-1:]}"
            state = page.evaluate(PANEL_JS, VISIBLE)
            if state and _states(state) == {"waiting"} and not shot:
                _shot(page, "06-waiting.png")
                shot = True
            samples += [state] if state else []
            time.sleep(0.1)
        cell = page.locator(
            f"{VISIBLE} .jp-CodeCell", has=page.locator(".jp-InputArea", has_text="hang_script = ")
        )
        table = cell.locator(".jp-OutputArea table")
        table.scroll_into_view_if_needed()
        page.screenshot(path=artifacts_dir() / "06-hang.png")
        lines = cell.evaluate(MIDWORD_JS)
    finally:
        page.set_viewport_size({"width": 1400, "height": 1000})

    waiting = [s for s in samples if _states(s) == {"waiting"}]
    assert waiting, f"the nodes never read 'waiting': {[_states(s) for s in samples][::10]}"
    assert waiting[-1]["hang"].startswith("Waiting: rank 0 waits in barrier at train_ddp.py:")
    said = cell.locator(".jp-OutputArea").inner_text()
    assert said.count("No rank has made progress") == 1, said  # e.stacks', not the panel's too
    final = page.evaluate(PANEL_JS, VISIBLE)
    assert final["hang"].startswith("The run hangs: stopped (on_hang='stop')"), final["hang"]
    assert _states(final) == {"failed"} and "(RunHung)" in final["status"], final
    assert "(loss.backward()" in table.inner_text()  # rank 1's line: its step, not a helper
    assert lines["wraps"] > 0 and not lines["broken"], lines


def test_dark_theme_four_nodes_and_stop_button_ends_every_process(lab, page):
    """About 45 s: four simulated nodes must be training (8 processes started on 2 cores)
    before the stop button can be shown to end every one of them."""
    with_parameters(
        REPO / "notebooks" / NB, lab.root / NB_4, run_dir="runs/ddp4", nnodes=4, epochs=100, **SMALL
    )
    _menu(page, "Settings", "Theme", "JupyterLab Dark")
    page.locator("body[data-jp-theme-light='false']").wait_for(state="attached")
    _open(page, lab, NB_4)
    page.locator("body[data-jp-theme-light='false']").wait_for(state="attached")
    _menu(page, "Run", "Run All Cells")

    deadline = time.monotonic() + 90
    while True:
        state = page.evaluate(PANEL_JS, VISIBLE)
        if state and state["plot"] and _states(state) == {"running"}:
            break
        assert time.monotonic() < deadline, f"4-node run not running with a plot: {state}"
        time.sleep(0.2)
    _shot(page, "03-dark-4nodes.png")
    assert len(state["rows"]) == 4
    for n in range(4):  # one line each, text readable on the dark background
        row = page.locator(f"{VISIBLE} .ddpnb-node").nth(n)
        assert row.bounding_box()["height"] < 30, f"row {n} wraps: {row.bounding_box()}"
        assert row.evaluate(CONTRAST_JS) >= 4.5, f"row {n}: low contrast"
    plot_filter = page.locator(f"{VISIBLE} img.ddpnb-plot").evaluate(
        "img => getComputedStyle(img).filter"
    )
    assert "invert" in plot_filter, "the live plot should be inverted in the dark theme"
    pids = training_pids(lab.root / "runs" / "ddp4")
    assert len(pids) >= 8, f"expected 4 agents and 4 workers, found {pids}"

    page.locator(f"{VISIBLE} .jp-Toolbar [data-jp-item-name='interrupt']").click()
    t = time.monotonic()
    while any(alive(p) for p in pids) or training_pids(lab.root / "runs" / "ddp4"):
        assert time.monotonic() - t < INTERRUPT_LIMIT, (
            f"still alive {INTERRUPT_LIMIT} s after the stop button: "
            f"{[p for p in pids if alive(p)]}"
        )
        time.sleep(0.1)
    stopped_in = time.monotonic() - t
    # The launch cell ends with the interrupt's traceback; the cells after it do not run.
    launch_cell = page.locator(
        f"{VISIBLE} .jp-CodeCell", has=page.locator(".jp-InputArea", has_text="job = ddpnb.launch(")
    )
    launch_cell.locator(".jp-OutputArea-output", has_text="KeyboardInterrupt").wait_for()
    # One short message: stopped, nothing left, how to resume; no traceback through ddpnb.
    said = launch_cell.locator(".jp-OutputArea").inner_text()
    assert "KeyboardInterrupt: the run in" in said and "no process of it is left" in said, said
    for frame in ("job.py", "launch.py", "wait() again", "Traceback"):
        assert frame not in said, said
    state = page.evaluate(PANEL_JS, VISIBLE)
    _shot(page, "03-dark-4nodes-stopped.png")
    assert _states(state) == {"stopped"}, state["rows"]
    # Each row still shows its workers' last line, not torchrun's SignalException.
    assert not [r for r in state["rows"] if "Exception" in r or "orch." in r], state["rows"]
    assert "interrupted" in state["status"] and "FAILED" not in state["status"]
    print(f"stop button -> no training process left in {stopped_in:.1f} s")


def test_shutdown_leaves_no_process(lab):
    lab.remember_pids()
    kernels = lab.api("kernels")
    assert kernels, "the notebooks' kernels should still be running here"
    seconds = lab.shutdown()
    assert lab.proc.returncode is not None, "JupyterLab did not exit on SIGTERM"
    left = [p for p in lab.pids_seen if alive(p)] + training_pids(lab.root / "runs")
    assert not left, f"processes left {seconds:.1f} s after shutdown: {left}"

"""Screenshot of the dltune panels as a user first sees them: a real TensorBoard, a real (headless) browser.

    .venv/bin/python scripts/panels_screenshot.py                      # runs the demo, then shoots
    .venv/bin/python scripts/panels_screenshot.py --logdir logs        # shoots existing runs (logs/demo/...)

The demo fit (the JPEG pipeline started at ``num_workers=0``, 4 epochs) decides early in its first epoch,
mid-epoch and at every epoch end, and logs ``dltune/recent/*`` every 10 steps. ``tensorboard --logdir``
starts on 127.0.0.1 (a free port) from the log dir's parent with the log dir's own name, so the Runs pane
shows ``logs``, no path of this machine. Headless Chromium, with a fresh profile (TensorBoard's default
settings: smoothing 0.6, "Ignore outliers in chart scaling" on), opens the custom-scalars dashboard and
writes the PNG (default: ``docs/panels.png``). It also reads what the page shows (each chart's title and
y-axis labels, the lines drawn, the settings) and prints it; ``tests/test_tensorboard.py`` asserts on
it. Needs the ``chromium`` browser (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import contextlib
import html
import http.server
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
PROBE_PATH = "/__dltune_probe"
_RESULT = re.compile(r'<pre id="dltune-probe"[^>]*>(.*?)</pre>', re.S)

# The page the browser opens: TensorBoard in a full-window frame of the same origin (so a script may read
# the dashboard's DOM, shadow roots included); once the charts stop changing, what they show goes into
# the <pre> that --dump-dom prints.
PROBE_PAGE = """<!doctype html><html><body style="margin:0;overflow:hidden">
<iframe id="tb" src="/#custom_scalars" style="width:100vw;height:100vh;border:0"></iframe>
<pre id="dltune-probe" style="display:none"></pre>
<script>
function deep(root, sel, found = []) {
  if (root.shadowRoot) deep(root.shadowRoot, sel, found);
  for (const k of Array.from(root.children || [])) { if (k.matches(sel)) found.push(k); deep(k, sel, found); }
  return found;
}
const texts = (root, sel) => deep(root, sel).map(e => e.textContent.trim()).filter(t => t);
function words(node) {  // the text a person reads in node, shadow roots included, styles left out
  if (node.nodeType === 3) return node.textContent;
  if (['STYLE', 'SCRIPT', 'TEMPLATE'].includes(node.nodeName)) return '';
  const kids = [...(node.shadowRoot ? node.shadowRoot.childNodes : []), ...node.childNodes];
  return kids.map(words).join(' ');
}
function look() {
  const doc = document.getElementById('tb').contentDocument;
  if (!doc || !doc.body) return null;
  const cards = deep(doc.body, 'tf-custom-scalar-margin-chart-card, tf-custom-scalar-multi-line-chart-card');
  const charts = cards.map(c => ({
    title: c.title,
    kind: c.tagName.toLowerCase().includes('margin') ? 'margin' : 'multiline',
    y_ticks: deep(c, '.y-axis').flatMap(a => texts(a, 'text')),
    lines: deep(c, 'path.line').map(p => p.getAttribute('d') || '').filter(d => d),
    warnings: texts(c, '.error-content'),
  }));
  const smoothing = deep(doc.body, 'tf-smoothing-input').map(e => e.weight);
  const outliers = deep(doc.body, 'paper-checkbox').filter(e => /outliers/i.test(e.textContent))
    .map(e => !!e.checked);
  const runs = deep(doc.body, 'tf-runs-selector').map(words).join(' ');
  return {charts, smoothing, ignore_outliers: outliers, runs_pane: runs.replace(/\\s+/g, ' ').trim()};
}
let last = '', same = 0;
const timer = setInterval(() => {
  let seen = null;
  try { seen = look(); } catch (e) { seen = {error: String(e)}; }
  const now = JSON.stringify(seen);
  const drawn = seen && seen.charts && seen.charts.length && seen.charts.every(c => c.y_ticks.length);
  same = (drawn && now === last) ? same + 1 : 0;
  last = now;
  if (same >= 3) { document.getElementById('dltune-probe').textContent = now; clearInterval(timer); }
}, 500);
</script></body></html>
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_demo(logdir: Path, epochs: int) -> None:
    """A short demo fit (the README's main command with fewer epochs) logging into ``logdir``."""
    dltune = Path(sys.executable).with_name("dltune")
    cmd = [str(dltune)] if dltune.exists() else [sys.executable, "-m", "lightning_dltune"]
    subprocess.run(
        cmd
        + [
            "fit",
            "--config",
            "configs/demo.yaml",
            f"--trainer.max_epochs={epochs}",
            f"--trainer.logger.init_args.save_dir={logdir}",
        ],
        cwd=ROOT,
        check=True,
    )


def wait_for(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"TensorBoard did not answer at {url}")
        time.sleep(0.5)


def browser() -> Optional[str]:
    """The Chromium (or Chrome) on PATH, or ``None``."""
    return next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)


def _proxy(tensorboard: str) -> type[http.server.BaseHTTPRequestHandler]:
    """A handler that serves :data:`PROBE_PAGE` and hands every other request to ``tensorboard``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet: the script prints what the page showed
            pass

        def do_GET(self) -> None:
            self._answer()

        def do_POST(self) -> None:
            self._answer(self.rfile.read(int(self.headers.get("Content-Length", 0))))

        def _answer(self, body: Optional[bytes] = None) -> None:
            if self.path.startswith(PROBE_PATH):
                status, headers, data = 200, [("Content-Type", "text/html")], PROBE_PAGE.encode()
            else:
                status, headers, data = _forward(tensorboard + self.path, self.command, dict(self.headers), body)
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def _forward(url: str, method: str, headers: dict[str, str], body: Optional[bytes]) -> tuple[int, list, bytes]:
    kept = {k: v for k, v in headers.items() if k.lower() in ("content-type", "accept", "x-xsrf-protected")}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method=method, headers=kept)) as r:
            status, reply, data = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, reply, data = e.code, e.headers, e.read()
    skip = ("transfer-encoding", "connection", "content-length")
    return status, [(k, v) for k, v in reply.items() if k.lower() not in skip], data


@contextlib.contextmanager
def tensorboard_page(logdir: Path) -> Iterator[str]:
    """A ``tensorboard --logdir`` of ``logdir`` (started from its parent, by its name) behind a local proxy
    that also serves the probe page; yields the proxy's base URL."""
    port = free_port()
    tensorboard = Path(sys.executable).with_name("tensorboard")
    cmd = [str(tensorboard)] if tensorboard.exists() else [sys.executable, "-m", "tensorboard.main"]
    logdir = logdir.resolve()
    server = subprocess.Popen(
        cmd + ["--logdir", logdir.name, "--host", "127.0.0.1", "--port", str(port)],
        cwd=logdir.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _proxy(f"http://127.0.0.1:{port}"))
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    try:
        wait_for(f"http://127.0.0.1:{port}/data/logdir")
        thread.start()
        yield f"http://127.0.0.1:{proxy.server_address[1]}"
    finally:
        if thread.is_alive():
            proxy.shutdown()
        proxy.server_close()
        server.terminate()
        server.wait(timeout=10)


def look(base: str, out: Path, width: int, height: int, wait_ms: int) -> dict[str, Any]:
    """Open the dashboard at default settings (a fresh browser profile), write the screenshot to ``out`` and
    return what the page showed: ``charts`` (title, kind, ``y_ticks``, ``lines`` as SVG paths, ``warnings``
    in display order), ``smoothing``, ``ignore_outliers`` and the ``runs_pane`` text."""
    chromium = browser()
    if chromium is None:
        raise FileNotFoundError("no chromium found: apt-get install chromium")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--virtual-time-budget={wait_ms}",
                f"--screenshot={out}",
                "--dump-dom",
                base + PROBE_PATH,
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=180,
        )
    found = _RESULT.search(done.stdout)
    if not found or not found.group(1).strip():
        raise RuntimeError(f"the page did not settle within {wait_ms} ms of browser time")
    return json.loads(html.unescape(found.group(1)))


def y_range(chart: dict[str, Any]) -> tuple[float, float]:
    """The lowest and highest label on a chart's y axis."""
    values = [float(t.replace(",", "")) for t in chart["y_ticks"]]
    return min(values), max(values)


def shoot(logdir: Path, out: Path, width: int = 1600, height: int = 2200, wait_ms: int = 30000) -> dict[str, Any]:
    """Serve ``logdir`` with TensorBoard, screenshot its custom scalars into ``out``; what the page showed."""
    with tensorboard_page(logdir) as base:
        return look(base, out, width, height, wait_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", type=Path, help="an existing log dir (default: run the demo first)")
    parser.add_argument("--epochs", type=int, default=4, help="demo epochs when no --logdir is given")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "panels.png")
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--height", type=int, default=2200)
    parser.add_argument("--wait-ms", type=int, default=30000, help="browser time for the page to render")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        logdir = args.logdir
        if logdir is None:
            logdir = Path(tmp) / "logs"
            run_demo(logdir, args.epochs)
        seen = shoot(logdir, args.out, args.width, args.height, args.wait_ms)
    for chart in seen["charts"]:
        low, high = y_range(chart)
        print(f"{chart['title']}: y {low:g} to {high:g}" + "".join(f"; {w}" for w in chart["warnings"]))
    print(f"smoothing {seen['smoothing']}, ignore outliers {seen['ignore_outliers']}; runs pane: {seen['runs_pane']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Screenshot of the dltune panels as a user sees them: a real TensorBoard, a real (headless) browser.

    .venv/bin/python scripts/panels_screenshot.py                      # runs the demo, then shoots
    .venv/bin/python scripts/panels_screenshot.py --logdir logs/demo   # shoots an existing run

The demo fit (the JPEG pipeline started at ``num_workers=0``, 4 epochs) decides early in its first
epoch and at every epoch end, and logs ``dltune/recent/*`` every 10 steps: several windows and a few
dozen step points. It starts ``tensorboard --logdir`` on 127.0.0.1 (a free port), opens the
custom-scalars dashboard in headless Chromium at TensorBoard's default settings (smoothing 0.6,
"ignore outliers" on) and writes the PNG (default: ``docs/panels.png``). Needs the ``chromium``
browser (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("no chromium found: apt-get install chromium")


def shoot(logdir: Path, out: Path, width: int, height: int, wait_ms: int) -> None:
    port = free_port()
    tensorboard = Path(sys.executable).with_name("tensorboard")
    cmd = [str(tensorboard)] if tensorboard.exists() else [sys.executable, "-m", "tensorboard.main"]
    server = subprocess.Popen(
        cmd + ["--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(f"{base}/data/logdir")
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [
                    browser(),
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--hide-scrollbars",
                    f"--user-data-dir={profile}",
                    f"--window-size={width},{height}",
                    f"--virtual-time-budget={wait_ms}",
                    f"--screenshot={out}",
                    f"{base}/#custom_scalars",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=120,
            )
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", type=Path, help="an existing log dir (default: run the demo first)")
    parser.add_argument("--epochs", type=int, default=4, help="demo epochs when no --logdir is given")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "panels.png")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=2450)
    parser.add_argument("--wait-ms", type=int, default=20000, help="browser time for the page to render")
    args = parser.parse_args()
    if args.logdir is None:
        with tempfile.TemporaryDirectory() as tmp:
            run_demo(Path(tmp), args.epochs)
            shoot(Path(tmp), args.out, args.width, args.height, args.wait_ms)
    else:
        shoot(args.logdir, args.out, args.width, args.height, args.wait_ms)


if __name__ == "__main__":
    main()

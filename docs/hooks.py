"""MkDocs hook: serve the committed benchmark plot from benchmarks/results/ without a copy in docs/."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = {"benchmarks/results/tuning.png": ROOT / "benchmarks" / "results" / "tuning.png"}


def on_files(files, config):
    for uri, path in OUTSIDE.items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files

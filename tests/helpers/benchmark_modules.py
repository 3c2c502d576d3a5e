"""Imports modules of ``benchmarks/`` for a test without leaving them importable in place of the tests' own helpers."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")


def load_benchmark_module(name: str, *needs: str) -> ModuleType:
    """``benchmarks/<name>.py``, importing the benchmark modules it ``needs`` alongside; ``sys.modules`` and
    ``sys.path`` are left as they were, so a benchmark module never stays importable in place of a test helper."""
    names = (name, *needs)
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, BENCHMARKS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCHMARKS)
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)

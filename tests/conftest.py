import os
import sys

import pytest

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
sys.path.insert(0, HELPERS)  # the tests' own modules (fit_workloads, pipeline_sim, ...) import as top-level modules


def _pin_hypothesis_constants() -> None:
    """Derandomized property tests draw the same examples whatever ran before them.

    Hypothesis (from 6.131) also draws literals found in the local modules imported so far, so the
    examples of a ``derandomize=True`` property would change with which other tests (and so which
    benchmark or example modules) ran first: a property could pass alone and fail in the suite, or a
    strict expected failure flip. Its pool of local literals is pinned empty here; where a Hypothesis
    release moves that internal, nothing is pinned and the tests run as before.
    """
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:
        return
    if callable(getattr(providers, "_get_local_constants", None)) and hasattr(providers, "Constants"):
        empty = providers.Constants()
        providers._get_local_constants = lambda: empty


_pin_hypothesis_constants()


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects anything: every collected test is checked
def pytest_collection_modifyitems(config, items):
    """A test that builds a Trainer (it asks for ``trainer_kwargs``) runs a real fit: it must be marked ``slow``.

    The mark is explicit (``pytestmark = pytest.mark.slow`` in a module of slow tests, ``@pytest.mark.slow`` on a
    test); this guard stops the run, naming the tests, where one was forgotten.
    """
    unmarked = [
        item.nodeid
        for item in items
        if "trainer_kwargs" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests ask for `trainer_kwargs` (a real fit) but are not marked slow; add `@pytest.mark.slow`, "
            "or `pytestmark = pytest.mark.slow` in a module of slow tests:\n  " + "\n  ".join(unmarked)
        )


@pytest.fixture
def trainer_kwargs(tmp_path):
    """Quiet, CPU-only Trainer arguments in ``tmp_path``."""
    return dict(
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
    )

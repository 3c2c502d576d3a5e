"""The demo check's reading of a demo console: the first look, contradicting verdicts, the recommendation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# loaded from its file: benchmarks/ stays off sys.path (the test helpers come first there)
_SPEC = importlib.util.spec_from_file_location(
    "demo_check", Path(__file__).resolve().parents[1] / "benchmarks" / "demo_check.py"
)
demo_check = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(demo_check)

TABLE = """\
lightning-dltune: loader tuning
epoch   batches   workers   prefetch   GPU busy   judged   starved   step ms   samples/s   verdict
───────────────────────────────────────────────────────────────────────────────────────────────────────────
    0   1-10            0          2       ~28%     ~28%       72%        32         279   data-bound (I/O)
    0   11-end          5          2       ~96%     ~96%        4%        40         762   in band
    1   1-end           5          2       ~95%     ~95%        5%        39         783   in band
"""
GOOD = (
    "[dltune] epoch 0 to batch 10 | workers 0 -> 5, prefetch 2 | GPU busy 28% (estimate) | data-bound (I/O)\n"
    "[dltune] validation at step 56 | workers 5, prefetch 2 | starved 12% | in band\n"
    "[dltune] epoch 0 | workers 5, prefetch 2 | GPU busy 96% (estimate) | in band\n"
    + TABLE
    + "recommended: workers=5 prefetch=2 pin=off persistent=on (762 samples/s, its median window: epoch 0)\n"
)


def test_a_good_demo_passes_every_check():
    result = demo_check.judge(GOOD, epochs=2)
    assert result["first_look_finds_starvation"] and not result["contradicting_verdicts"]
    assert result["recommendation_not_slower"] and result["best_config_median_last_two_epochs_samples_per_s"] == 772.5


def test_a_first_look_in_band_a_data_bound_verdict_at_98_and_a_slow_recommendation_are_caught():
    bad = (
        GOOD.replace(
            "workers 0 -> 5, prefetch 2 | GPU busy 28% (estimate) | data-bound (I/O)",
            "workers 0, prefetch 2 | GPU busy 85% (estimate) | in band",
        )
        .replace("GPU busy 96% (estimate) | in band", "GPU busy 98% (estimate) | data-bound (CPU saturated)")
        .replace("workers=5 prefetch=2 pin=off persistent=on (762", "workers=0 prefetch=2 (279")  # slower than 5 x 2
    )
    result = demo_check.judge(bad, epochs=2)
    assert not result["first_look_finds_starvation"]
    assert result["contradicting_verdicts"] == [
        "[dltune] epoch 0 | workers 5, prefetch 2 | GPU busy 98% (estimate) | data-bound (CPU saturated)"
    ]
    assert not result["recommendation_not_slower"]


ONE_CONFIG = """\
lightning-dltune: loader tuning
epoch   batches   workers   prefetch   GPU busy   judged   starved   step ms   samples/s   verdict
───────────────────────────────────────────────────────────────────────────────────────────────────────────
    0   1-end           5          2       ~95%     ~95%        5%        40         700   in band
    1   1-end           5          2       ~95%     ~95%        5%        39         783   in band
    2   1-end           5          2       ~95%     ~95%        5%        39         815   in band
recommended: workers=5 prefetch=2 pin=off persistent=on (726 samples/s, its median window: epoch 1)
"""


def test_a_recommendation_is_compared_with_the_others_over_the_same_epochs_not_with_its_own_later_windows():
    # one config the whole fit: the median it quotes (over all its windows) is below its last two epochs' one,
    # and no other config ran there: nothing measured under the same conditions was faster
    result = demo_check.judge(GOOD.split(TABLE)[0] + ONE_CONFIG, epochs=3)
    assert result["recommended_median_last_two_epochs_samples_per_s"] == 799.0
    assert result["recommendation_not_slower"]

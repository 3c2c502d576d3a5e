"""console: lines go through an enabled progress bar; a notice is said once per fit."""

import warnings

from lightning_dltune.report.console import Notices, say


class Bar:
    def __init__(self, enabled):
        self.is_enabled = enabled
        self.printed = []

    def print(self, text):
        self.printed.append(text)


class Trainer:
    def __init__(self, bar, zero=True):
        self.progress_bar_callback = bar
        self.is_global_zero = zero


def test_a_line_goes_through_an_enabled_bar_on_rank_zero_only():
    bar = Bar(True)
    say(Trainer(bar), "[dltune] hello")
    say(Trainer(bar, zero=False), "[dltune] not from rank 1")
    assert bar.printed == ["[dltune] hello"]


def test_without_an_enabled_bar_the_line_goes_to_lightnings_logger(caplog):
    bar = Bar(False)
    with caplog.at_level("INFO"):
        say(Trainer(bar), "[dltune] logged")
    assert bar.printed == [] and "[dltune] logged" in caplog.text


def test_a_notice_is_said_once_per_fit_and_again_after_a_reset():
    bar = Bar(True)
    notices = Notices()
    for _ in range(3):
        notices.once(Trainer(bar), "key", "said once")
    notices.reset()
    notices.once(Trainer(bar), "key", "said once")
    assert bar.printed == ["said once", "said once"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notices.once(None, "warn", "a warning on every rank", warn=True, all_ranks=True)
        notices.once(None, "warn", "a warning on every rank", warn=True, all_ranks=True)
    assert [str(w.message) for w in caught] == ["a warning on every rank"]

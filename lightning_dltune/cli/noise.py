"""Known noise that ``dltune`` hides while it runs: Lightning's install tips and third-party deprecations.

Only inside the command (:func:`quiet_known_noise` wraps ``main()``): a user's own LightningCLI, or
the package used as a library, still sees all of them. Each filter names one message, so the user's
own warnings and Lightning's other warnings and logs still show.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from typing import Iterator

# torch >= 2.10 deprecates the pytree names that lightning.pytorch.utilities._pytree still uses
DEPRECATIONS = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    (r"`torch\.utils\._pytree\._register_pytree_node` is deprecated", FutureWarning),
)
# the Trainer's advertisements for litlogger and litmodels, logged at INFO on every fit
TIPS = re.compile(r"^💡 Tip: For seamless cloud (logging|uploads)")
# rank_zero_info logs through whichever of these lightning_utilities was pointed at last
TIP_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning_utilities.core.rank_zero",
)


class _DropTips(logging.Filter):
    """Drops Lightning's install tips, passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not TIPS.match(str(record.msg))


@contextlib.contextmanager
def quiet_known_noise() -> Iterator[None]:
    """Within the block, hide :data:`DEPRECATIONS` and Lightning's :data:`TIPS`."""
    tips = _DropTips()
    loggers = [logging.getLogger(name) for name in TIP_LOGGERS]
    with warnings.catch_warnings():
        for message, category in DEPRECATIONS:
            warnings.filterwarnings("ignore", message=message, category=category)
        for logger in loggers:
            logger.addFilter(tips)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(tips)

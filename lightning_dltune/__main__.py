"""``python -m lightning_dltune``: the ``dltune`` command, with its exit status."""

import sys

from lightning_dltune.cli import main

sys.exit(main())

"""``python -m lightning_dltune``: the ``dltune`` command, with its exit status."""

import os
import sys

from lightning_dltune.cli.command import main

# `python -m` puts the current directory first; search it last, as the installed `dltune` does
if sys.path and sys.path[0] in ("", os.getcwd()):
    sys.path.append(sys.path.pop(0))
sys.exit(main())

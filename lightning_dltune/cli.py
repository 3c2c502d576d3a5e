"""The ``dltune`` command: a LightningCLI whose model and data are any classes named in YAML.

    dltune fit --config configs/demo.yaml
    dltune fit --config configs/demo.yaml --config logs/demo/version_0/dltune_recommendation.yaml
    python -m lightning_dltune fit --config configs/monitor_only.yaml

Class paths resolve from the current directory too (``examples.image_pipeline.JpegDataModule`` from
a checkout's root). Bad values are reported before training starts, naming the key, and the command
exits with status 2.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from lightning.pytorch.cli import ArgsType, LightningCLI


class DLTuneCLI(LightningCLI):
    """LightningCLI that turns a bad argument into a command-line error instead of a traceback."""

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as exc:
            self.parser.error(f"invalid configuration: {exc}")


def main(args: ArgsType = None, run: bool = True) -> Optional[Any]:
    """Run the CLI (``args``: command-line words; ``None``: ``sys.argv``)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return DLTuneCLI(
        args=args,
        run=run,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": "lightning-dltune: a LightningCLI that measures and tunes your DataLoaders."},
    )


if __name__ == "__main__":
    main()

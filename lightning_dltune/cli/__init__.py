"""The ``dltune`` command: LightningCLI for fits and ``dltune sweep`` for the ladder test."""

from lightning_dltune.cli.command import main

__all__ = ["main"]

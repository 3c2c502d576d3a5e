"""lightning-dltune: stop GPUs from starving. Measure data starvation inside the fit and retune loaders."""

from lightning_dltune.callback import DataLoaderTuner
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.datamodule import TunableDataModule

__all__ = ["DataLoaderTuner", "LoaderConfig", "TunableDataModule"]
__version__ = "0.1.0"

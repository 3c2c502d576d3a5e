"""Does tuning the validation loaders on their own pay? Validation wall time and fit time, one workload.

    python benchmarks/validation.py                 # ~3 min on 2 cores; writes benchmarks/results/validation.json
    python benchmarks/validation.py --epochs 2      # shorter

The workload validates four times an epoch over a set a fifth the size of training, with a validation
step a third of the training step (no backward pass), so the validation loop starves where training
does not. Every strategy tunes the training loaders the same way (``DataLoaderTuner`` defaults); they
differ in the validation loaders:

- ``follows train``: ``tune_validation=False``, the validation loaders run the training config (the
  behaviour before validation was tuned on its own);
- ``tuned``: the default, the validation loaders get a config of their own from their own runs;
- ``static k``: ``val_num_workers=k`` fixed (``tune_validation=False``), for each ``k`` of the grid.

Each fit runs in its own process. The accelerator step is emulated by a sleep in the training process
(the host idles while a GPU computes); storage latency by a sleep per batch in the dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_SAMPLES, VAL_SAMPLES, BATCH = 480, 96, 8  # the held-out set is a fifth of the training set
TRAIN_STEP_S, VAL_STEP_S = 0.030, 0.010  # a validation step is a third of a training step
BATCH_COST_S = 0.020  # storage latency per batch, the same for both sets
START_WORKERS = 1  # training is fed at 1 worker (20 ms a batch against a 30 ms step); validation is not


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One fit in this process: the workload under ``spec``'s validation strategy."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import Dataset

    from lightning_dltune import DataLoaderTuner, TunableDataModule

    torch.set_num_threads(1)

    class Slow(Dataset):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitems__(self, indices: list) -> list:
            time.sleep(BATCH_COST_S)
            return [torch.full((8,), float(i)) for i in indices]

    class Data(TunableDataModule, pl.LightningDataModule):
        def setup(self, stage: str) -> None:
            self.train_dataset, self.val_dataset = Slow(TRAIN_SAMPLES), Slow(VAL_SAMPLES)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            time.sleep(TRAIN_STEP_S)
            return self.layer(batch).sum()

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            time.sleep(VAL_STEP_S)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class ValClock(pl.Callback):
        def __init__(self) -> None:
            self.seconds, self._t0 = 0.0, 0.0

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            self._t0 = time.perf_counter()

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if not trainer.sanity_checking:
                self.seconds += time.perf_counter() - self._t0

    val_workers = spec.get("val_workers")
    tuner = DataLoaderTuner(tune_validation=spec["tune_validation"], util_source="estimate", verbose=False)
    clock = ValClock()
    trainer = pl.Trainer(
        max_epochs=spec["epochs"],
        val_check_interval=0.25,
        callbacks=[tuner, clock],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = Data(batch_size=BATCH, num_workers=START_WORKERS, val_num_workers=val_workers)
    t0 = time.perf_counter()
    trainer.fit(Model(), datamodule=data)
    return {
        "fit_s": time.perf_counter() - t0,
        "val_s": clock.seconds,
        "val_runs": len(tuner.val_history),
        "val_workers": [r.num_workers for r in tuner.val_history],
        "train_workers": [r.num_workers for r in tuner.history],
    }


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, __file__, "--run-one", json.dumps(spec)], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"the fit of {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Any = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--grid", type=int, nargs="+", default=[1, 2, 3, 4], help="static val worker counts")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "validation.json"))
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        print(json.dumps(run_one(json.loads(args.run_one))))
        return {}
    strategies = {"follows train": {"tune_validation": False}, "tuned": {"tune_validation": True}}
    for k in args.grid:
        strategies[f"static {k}"] = {"tune_validation": False, "val_workers": k}
    results = {}
    for name, spec in strategies.items():
        results[name] = _child({**spec, "epochs": args.epochs})
        print(f"{name:>14}: fit {results[name]['fit_s']:6.1f} s, validation {results[name]['val_s']:5.1f} s")
    best = min((n for n in results if n.startswith("static")), key=lambda n: results[n]["val_s"])
    summary = {
        "best_static": best,
        "tuned_val_vs_best_static": results["tuned"]["val_s"] / results[best]["val_s"],
        "tuned_fit_vs_follows_train": results["tuned"]["fit_s"] / results["follows train"]["fit_s"],
        "tuned_val_vs_follows_train": results["tuned"]["val_s"] / results["follows train"]["val_s"],
    }
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"epochs": args.epochs, "results": results, "summary": summary}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()

"""The ``dltune`` command: a LightningCLI whose model and data are any classes named in YAML.

    dltune fit --config configs/demo.yaml
    dltune fit --config configs/demo.yaml --config logs/demo/version_0/dltune_recommendation.yaml
    dltune sweep --config configs/demo.yaml          # the ladder test: every workers x prefetch point
    dltune report logs/demo/version_0                # the fit's timeline picture, redrawn from its events
    python -m lightning_dltune fit --config configs/monitor_only.yaml

Class paths resolve from the current directory too (``examples.image_pipeline.JpegDataModule`` from
a checkout's root); the directory is searched after installed packages, so a stray file there
(a ``pynvml.py``) never shadows a real module. Bad values are reported before anything starts,
naming the key, and the command exits with status 2; a finished command exits with 0.
"""

from __future__ import annotations

import logging
import os
import re
import statistics
import sys
import textwrap
import time
from typing import Any, Optional, Sequence

from lightning.pytorch.cli import ArgsType, LightningCLI

from lightning_dltune.cli.noise import quiet_known_noise
from lightning_dltune.cli.parser import DLTuneArgumentParser
from lightning_dltune.cli.report import REPORT_DESCRIPTION, REPORT_HELP, report_command

DESCRIPTION = "lightning-dltune: a LightningCLI that measures and tunes your DataLoaders."
SWEEP_DESCRIPTION = (
    "dltune sweep: the ladder test. Measures the training step once, then times the train loader alone at"
    " each num_workers x prefetch_factor point within the tuner's budget, and writes a table, a heatmap,"
    " a JSON file and a recommendation that `dltune fit --config <your config> --config <it>` accepts."
    " Takes the same config as `dltune fit`."
)
EXIT_INTERRUPTED = 130


SWEEP_HELP = "The loader ladder test: times every num_workers x prefetch_factor point (dltune sweep --help)."


class DLTuneCLI(LightningCLI):
    """LightningCLI that says a bad argument in one paragraph (exit 2) and lists ``sweep`` among its subcommands."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", DLTuneArgumentParser)
        super().__init__(*args, **kwargs)

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        """LightningCLI's parsers, plus ``sweep`` in the subcommand list (``main()`` runs it before this parser)."""
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        subcommands = getattr(self.parser, "subcommands_action", None)
        if add_subcommands and subcommands is not None:
            subcommands.add_subcommand("sweep", DLTuneArgumentParser(description=SWEEP_DESCRIPTION), help=SWEEP_HELP)
            subcommands.add_subcommand("report", DLTuneArgumentParser(description=REPORT_DESCRIPTION), help=REPORT_HELP)

    def before_instantiate_classes(self) -> None:
        """``sweep`` and ``report`` are listed for ``--help`` only: ``main()`` runs them when first."""
        if self.subcommand == "sweep":
            self.parser.error("`sweep` must come first: dltune sweep --config <your config> [options]")
        if self.subcommand == "report":
            self.parser.error("`report` must come first: dltune report LOGDIR [--output PATH]")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as exc:
            config = self.config.get(self.subcommand) if self.subcommand else self.config
            self.parser.error(_located(str(exc), config))  # the parser finds the subcommand's own help


def _located(message: str, config: Any) -> str:
    """``message`` of an error raised while building a class, prefixed with the config key of that class.

    jsonargparse names only the class (``Namespace(class_path=...)``) when a constructor fails; the key,
    found by the class path in ``config``, is what the user edits. Written in jsonargparse's own form so
    that the parser's :func:`~lightning_dltune.cli.errors.condense` reads it like any other report.
    """
    paths = set(re.findall(r"class_path='([^']+)'", message))
    keys = _keys_of_class_path(config, paths.pop()) if len(paths) == 1 else []
    if len(keys) != 1:
        return message
    return f'Parser key "{keys[0]}":\n' + textwrap.indent(message, "  ")


def _keys_of_class_path(config: Any, class_path: str, prefix: str = "") -> list[str]:
    """Every key of ``config`` (a jsonargparse Namespace) whose value, or an item of it, has ``class_path``."""
    found = []
    for key, value in vars(config).items() if hasattr(config, "__dict__") else []:
        here = f"{prefix}{key}"
        items = value if isinstance(value, list) else [value]
        if any(getattr(item, "class_path", None) == class_path for item in items):
            found.append(here)
        elif hasattr(value, "__dict__") and not hasattr(value, "class_path"):
            found += _keys_of_class_path(value, class_path, f"{here}.")
    return found


class SweepCLI(DLTuneCLI):
    """The fit config (trainer, model, data) plus the sweep's own options, checked before anything starts."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            *_spellings("--step_ms"),
            type=Optional[float],
            default=None,
            help="Emulated training step in ms; default: measure real steps of the model.",
        )
        parser.add_argument("--steps", type=int, default=10, help="Real training steps to time (after 3 warm-up).")
        parser.add_argument(
            *_spellings("--seconds_per_point"),
            type=float,
            default=3.0,
            help="Time the loader runs at each grid point, after its first batch.",
        )
        parser.add_argument(
            "--workers",
            type=Optional[list[int]],
            default=None,
            help="num_workers values, e.g. [0,2,4]; default: 0, 1, 2, 4, ... up to the budget.",
        )
        parser.add_argument("--prefetch", type=list[int], default=[1, 2, 4], help="prefetch_factor values.")
        parser.add_argument(
            *_spellings("--min_gain"),
            type=Optional[float],
            default=None,
            help="Recommend the leanest point within this share of the best samples/s;"
            " default: the DataLoaderTuner's min_gain in the config, else 0.05.",
        )
        parser.add_argument(
            "--out",
            type=str,
            default="dltune_sweep",
            help="Directory for dltune_sweep.json, dltune_sweep.png and dltune_recommendation.yaml.",
        )

    def before_instantiate_classes(self) -> None:
        c = self.config
        checks = [
            ("--step_ms", c.step_ms is None or c.step_ms >= 0, "a number >= 0"),
            ("--steps", c.steps >= 1, "an integer >= 1"),
            ("--seconds_per_point", c.seconds_per_point > 0, "a number > 0"),
            (
                "--workers",
                c.workers is None or (c.workers and min(c.workers) >= 0),
                "a non-empty list of integers >= 0",
            ),
            ("--prefetch", bool(c.prefetch) and min(c.prefetch) >= 1, "a non-empty list of integers >= 1"),
            ("--min_gain", c.min_gain is None or 0 <= c.min_gain < 1, "a number in [0, 1)"),
        ]
        for option, ok, allowed in checks:
            if not ok:
                self.parser.error(f"`{option}` must be {allowed}, got {c[option.lstrip('-')]!r}.")


def _spellings(option: str) -> tuple[str, ...]:
    """``option`` and, for a multi-word one, its hyphenated alias (``--step_ms``, ``--step-ms``).

    The first spelling names the key (``step_ms``) and is the one help and errors show.
    """
    alias = "--" + option[2:].replace("_", "-")
    return (option,) if alias == option else (option, alias)


def _import_from_cwd() -> None:
    """Let class paths name modules of the current directory, after installed packages.

    By its absolute path: jsonargparse imports a config's class paths from the config file's folder (it
    changes into it), where an entry ``""`` (``python -c``, a notebook) would no longer name this directory.
    """
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)


def build_cli(args: ArgsType = None, run: bool = True) -> DLTuneCLI:
    """The ``dltune`` LightningCLI (``args``: command-line words; ``None``: ``sys.argv``)."""
    _import_from_cwd()
    return DLTuneCLI(
        args=args,
        run=run,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={
            "description": DESCRIPTION
            + " `dltune sweep --help`: the loader ladder test; `dltune report --help`: a fit's timeline picture."
        },
    )


def main(args: Optional[Sequence[str]] = None) -> int:
    """Run ``dltune`` (``args``: command-line words; ``None``: ``sys.argv``); returns the exit status.

    0 when the command finished; a bad configuration exits with 2 (``SystemExit``) before anything
    starts; an interrupted sweep returns 130 after shutting its loader workers down.
    """
    words = list(sys.argv[1:] if args is None else args)
    with quiet_known_noise():
        if words[:1] == ["sweep"]:
            return sweep_command(words[1:])
        if words[:1] == ["report"]:
            return report_command(words[1:])
        build_cli(args if args is None else words)  # None: LightningCLI reads sys.argv itself
    return 0


def sweep_command(args: Sequence[str]) -> int:
    """``dltune sweep``: parse the config, then measure the grid (see :mod:`lightning_dltune.cli.sweep`)."""
    from lightning_dltune.datamodule import TunableDataModule

    _import_from_cwd()
    argv, sys.argv = sys.argv, ["dltune sweep", *args]  # LightningCLI warns when given words and sys.argv both
    try:
        with _QuietLightning():
            cli = SweepCLI(
                run=False,
                subclass_mode_model=True,
                subclass_mode_data=True,
                parser_kwargs={"prog": "dltune sweep", "description": SWEEP_DESCRIPTION},
            )
    finally:
        sys.argv = argv
    if not isinstance(cli.datamodule, TunableDataModule):
        cli.parser.error(
            f"`data` must be a TunableDataModule for `dltune sweep` (it builds each point's loader), got"
            f" {type(cli.datamodule).__name__}: add the lightning_dltune.TunableDataModule mixin to it."
        )
    from lightning_dltune.cli.interrupt import StopRequest

    try:
        with StopRequest().installed() as stop:
            _run_sweep(cli, stop)
    except KeyboardInterrupt:
        print("dltune sweep: interrupted; the loader workers were shut down.", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _run_sweep(cli: SweepCLI, stop: Any) -> None:
    from lightning_dltune.cli import sweep, sweep_report

    options, datamodule = cli.config, cli.datamodule
    started = time.perf_counter()
    budget, min_gain = _tuner_limits(cli)
    original = None
    try:
        samples, step_s, source = _step(cli)
        stop.check()
        original = datamodule.loader_config
        make_loader = sweep.datamodule_loaders(datamodule)
        batch_bytes = _first_batch_bytes(make_loader, original)
        pin = (False, True) if cli.trainer.strategy.root_device.type == "cuda" else (False,)
        configs, skipped = sweep.build_grid(original, budget, batch_bytes, options.workers, options.prefetch, pin)
        result = sweep.SweepResult(
            step_ms=1e3 * step_s,
            step_source=source,
            batch_size=datamodule.batch_size,
            batch_bytes=batch_bytes,
            seconds_per_point=options.seconds_per_point,
            min_gain=min_gain,
            budget=budget,
            skipped=skipped,
            step_samples_ms=[1e3 * x for x in samples],
        )
        _say(
            f"step {sweep_report.step_text(result)}; {len(configs)} points x {result.seconds_per_point:g} s,"
            f" budget: {budget.max_workers} workers"
        )
        sweep.run_grid(make_loader, result, configs, on_point=_report_point, stop=stop.check)
    finally:
        if original is not None:
            datamodule.set_loader_config(original)
    result.elapsed_s = time.perf_counter() - started
    print(sweep_report.sweep_table(result), flush=True)
    _write_outputs(result, options.out)


def _tuner_limits(cli: SweepCLI) -> tuple[Any, float]:
    """The rank budget and ``min_gain`` the config's DataLoaderTuner would use (its defaults without one)."""
    from lightning_dltune.callback import DataLoaderTuner
    from lightning_dltune.control.resources import rank_budget
    from lightning_dltune.core.records import PolicySettings

    tuner = next((cb for cb in cli.trainer.callbacks if isinstance(cb, DataLoaderTuner)), None)
    limits = (
        {}
        if tuner is None
        else {
            "max_workers": tuner.max_workers,
            "memory_fraction": tuner.memory_fraction,
            "shm_fraction": tuner.shm_fraction,
        }
    )
    budget = rank_budget(local_ranks=max(1, cli.trainer.num_devices), **limits)  # the fit's ranks on this node share it
    min_gain = cli.config.min_gain
    if min_gain is None:
        min_gain = (tuner.settings if tuner is not None else PolicySettings()).min_gain
    return budget, min_gain


def _step(cli: SweepCLI) -> tuple[list[float], float, str]:
    """(every timed step, the step in seconds, its source); sets the datamodule up either way."""
    from lightning_dltune.cli import sweep

    options, trainer, datamodule = cli.config, cli.trainer, cli.datamodule
    if options.step_ms is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
        return [], options.step_ms / 1e3, "--step_ms"
    device = trainer.strategy.root_device
    trainer_kwargs = {
        "accelerator": device.type,
        "precision": trainer.precision,
        "devices": [device.index] if device.index is not None else 1,
    }
    _say(f"timing {options.steps} training steps of {type(cli.model).__name__} on {device}")
    with _QuietLightning():
        samples = sweep.measure_steps_s(cli.model, datamodule, trainer_kwargs, options.steps)
    return samples, statistics.median(samples), "measured"


def _write_outputs(result: Any, out: str) -> None:
    from lightning_dltune.cli import sweep_report
    from lightning_dltune.report.recommendation import write_recommendation

    os.makedirs(out, exist_ok=True)
    written = [sweep_report.write_json(result, os.path.join(out, sweep_report.JSON_FILE))]
    try:
        written.append(sweep_report.write_heatmap(result, os.path.join(out, sweep_report.HEATMAP_FILE)))
    except ImportError:
        _say("heatmap skipped: matplotlib is not installed (pip install matplotlib)")
    rec = result.recommended
    if rec is not None:
        written.append(
            write_recommendation(
                out,
                rec.config,
                note=(
                    f"dltune sweep: leanest within {result.min_gain:.0%} of the best predicted fit"
                    f" ({rec.fit_samples_per_s:,.0f} samples/s) with a {sweep_report.step_text(result)} step"
                ),
            )
        )
    _say(f"{len(result.points)} points in {result.elapsed_s:.0f} s; wrote " + ", ".join(written))


def _first_batch_bytes(make_loader: Any, base: Any) -> float:
    """Bytes of one batch, from a loader without workers (the budget needs it before any point runs)."""
    from lightning_dltune.cli import sweep
    from lightning_dltune.loaders.torch_internals import shutdown_workers

    loader = make_loader(base.replace(num_workers=0))
    try:
        return float(sweep.batch_nbytes(next(iter(loader))))
    finally:
        shutdown_workers(loader)


def _report_point(point: Any) -> None:
    c = point.config
    _say(
        f"workers={c.num_workers} prefetch={c.prefetch_factor if c.num_workers else '-'}"
        f"{' pin' if c.pin_memory else ''}: {point.samples_per_s:,.0f} samples/s,"
        f" start-up {point.startup_s:.2f} s, predicted starvation {point.predicted_starvation:.0%}"
    )


def _say(message: str) -> None:
    print(f"[dltune sweep] {message}", flush=True)


class _QuietLightning:
    """Hide Lightning's set-up chatter (devices, model summary) while the step is timed."""

    _NAMES = ("lightning.pytorch", "lightning.fabric")

    def __enter__(self) -> None:
        self._levels = [(logging.getLogger(n), logging.getLogger(n).level) for n in self._NAMES]
        for logger, _ in self._levels:
            logger.setLevel(logging.WARNING)

    def __exit__(self, *exc: Any) -> None:
        for logger, level in self._levels:
            logger.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())

"""A workload's runs judged: each strategy's median run summarised, and the tuned runs against the oracle.

:func:`analyse` turns what :func:`workload_runs.run_workload` measured into the results' ``strategies``
(one summary per strategy), ``runs`` (every run, slimmed), ``tuned`` (per start: tuned / oracle
time, on the phase after the change for a workload whose conditions change, and the other ratios the
targets check, with where the extra time went) and ``own_loaders`` (per start: the tuned fit of the
project's own loaders against the oracle and against the mixin's tuned fit of that start, judged on the
same part of the fit).
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from strategies import BAND, LABELS, MIXIN_OF, START_OF, STRATEGIES, config_dict

STABLE_VERDICTS = ("compute-bound", "data-bound (CPU saturated)", "memory-capped")


def until_in_band(epochs: list[dict[str, Any]]) -> tuple[Optional[int], str]:
    """First epoch inside the band, else the first epoch of a stable final verdict that holds to the end."""
    for e in epochs:
        if BAND[0] <= e["utilization"] <= BAND[1]:
            return e["epoch"], "in band"
    for i, e in enumerate(epochs):
        if e["verdict"] in STABLE_VERDICTS and not any(x["changed"] for x in epochs[i:]):
            return e["epoch"], e["verdict"]
    if not epochs:
        return None, "no epochs"
    return None, f"last: {epochs[-1]['verdict']}, util {epochs[-1]['utilization']:.0%}"


def summarize_strategy(strategy: str, runs: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
    """The median run of ``strategy`` by fit time, summarised: configs, speeds, band, rebuilds, memory."""
    ok = [r for r in runs if "error" not in r and r.get("epochs")]
    if not ok:
        return {"label": LABELS[strategy], "error": (runs[0].get("error") if runs else "not run")}
    run = sorted(ok, key=lambda r: r["fit_s"])[len(ok) // 2]  # the median run (the upper one of two)
    es = run["epochs"]
    in_band_epoch, how = until_in_band(es)
    changes = sum(
        1
        for a, b in zip(es, es[1:])
        if (a["num_workers"], a["prefetch_factor"]) != (b["num_workers"], b["prefetch_factor"])
    )
    half = es[len(es) // 2 :]
    return {
        "label": LABELS[strategy],
        "start_config": {"num_workers": run["spec"]["num_workers"], "prefetch_factor": run["spec"]["prefetch_factor"]},
        "final_config": {"num_workers": es[-1]["num_workers"], "prefetch_factor": es[-1]["prefetch_factor"]},
        "tuned": run["spec"]["tune"],
        "fit_s": run["fit_s"],
        "fit_s_all_runs": [r["fit_s"] for r in ok],
        "samples_per_s": [e["samples_per_s"] for e in es],
        "steady_samples_per_s": statistics.mean(e["samples_per_s"] for e in half),
        "fit_samples_per_s": sum(e["samples"] for e in es) / run["fit_s"],
        "epoch_wall_s": [e["wall_s"] for e in es],
        "configs": [[e["num_workers"], e["prefetch_factor"]] for e in es],
        "utilization": [e["utilization"] for e in es],
        "verdicts": [e["verdict"] for e in es],
        "reasons": [e["reason"] for e in es],
        "worker_batch_ms": [e["worker_batch_ms"] for e in es],
        "in_band_epoch": in_band_epoch,
        "in_band_how": how,
        "until_in_band": f"{in_band_epoch} ({how})" if in_band_epoch is not None else f"never ({how})",
        "final_verdict": es[-1]["verdict"],
        "rebuilds": run["loader_rebuilds"] if run["spec"]["tune"] else changes,  # tuner.rebuilds counts config changes
        "loader_rebuilds": run["loader_rebuilds"],
        "peak_memory_mb": run["memory"].get("peak_mb"),
        "peak_memory_epoch": run["memory"].get("peak_epoch"),
        "peak_pss_mb": run["memory"].get("peak_pss_mb"),
        "peak_uss_mb": run["memory"].get("peak_uss_mb"),
        "peak_shm_mb": run["memory"].get("peak_shm_mb"),
        "peak_procs": run["memory"].get("peak_procs"),
        "steady_peak_memory_mb": run["memory_steady"].get("peak_mb"),
        "memory_fraction": run.get("memory_fraction"),
        "memory_budget_mb": [e["memory_budget_mb"] for e in es],
        "load_avg_1m": run["load_avg_1m"],
        "epochs": len(es),
        "complete": len(es) == epochs,
        "phase_s": run.get("phase_s"),
        "band_reached_batch": run.get("band_reached_batch"),
        "band_reached_after_change": run.get("band_reached_after_change"),
        "util_blocks": run.get("util_blocks", []),
        "next_configs": [[e["next_num_workers"], e["next_prefetch_factor"]] for e in es],
        "hog_s": run.get("hog_s"),
        "windows": run.get("windows", []),
    }


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b``, ``None`` where either is missing or ``b`` is 0."""
    return a / b if a is not None and b not in (None, 0) else None


def excess_breakdown(tuned: dict[str, Any], oracle: dict[str, Any]) -> dict[str, float]:
    """Where a tuned fit's extra time over the oracle went, epoch by epoch.

    Each tuned epoch is compared with the oracle's epoch 0 (for epoch 0: both start their workers) or
    with the oracle's mean steady epoch; epochs are grouped into epoch 0 at the start config, the
    epochs while the config still changed, and the epochs at the final config.
    """
    o_walls = [w for w in oracle["epoch_wall_s"] if w]
    t_walls = tuned["epoch_wall_s"]
    if not o_walls or not t_walls or None in t_walls:
        return {}
    o_first = o_walls[0]
    o_steady = statistics.mean(o_walls[1:]) if len(o_walls) > 1 else o_first
    configs = [tuple(c) for c in tuned["configs"]]
    settled = next(i for i in range(len(configs)) if all(c == configs[-1] for c in configs[i:]))
    excess = [w - (o_first if i == 0 else o_steady) for i, w in enumerate(t_walls)]
    first = 1 if settled > 0 else 0  # an untouched start config is the settled config from epoch 0
    return {
        "total_s": tuned["fit_s"] - oracle["fit_s"],
        "epoch0_s": excess[0] if settled > 0 else 0.0,
        "retuning_s": sum(excess[first:settled]),
        "settled_s": sum(excess[settled:]),
        "outside_epochs_s": (tuned["fit_s"] - sum(t_walls)) - (oracle["fit_s"] - sum(o_walls)),
        "settled_epoch": settled,
    }


def analyse(workload_result: dict[str, Any], epochs: int) -> dict[str, Any]:
    """``workload_result`` with its raw runs replaced by ``strategies``, ``runs`` and ``tuned`` (see the module)."""
    raw = workload_result.pop("raw_runs")
    strategies = {s: summarize_strategy(s, raw[s], epochs) for s in STRATEGIES}
    workload_result["strategies"] = strategies
    workload_result["runs"] = {s: [_slim(r) for r in raw[s]] for s in STRATEGIES}
    default, oracle = strategies["default"], strategies["oracle"]
    tuned = {}
    for start, key in (("from_default", "tuned_default"), ("from_bad", "tuned_bad")):
        t = strategies[key]
        if "error" in t or "error" in oracle:
            tuned[start] = {"tuned_over_oracle_time": None, "error": t.get("error") or oracle.get("error")}
            continue
        judged = bool(workload_result.get("phase_start"))
        tuned[start] = {
            # a phased workload is judged on its phase (from the fits' batch clocks), the others on the whole fit
            "tuned_over_oracle_time": (
                ratio(t["phase_s"], oracle["phase_s"]) if judged else ratio(t["fit_s"], oracle["fit_s"])
            ),
            "tuned_over_oracle_fit_time": ratio(t["fit_s"], oracle["fit_s"]),
            "judged": workload_result.get("judged", "the whole fit"),
            "phase_s": t["phase_s"] if judged else None,
            "oracle_phase_s": oracle["phase_s"] if judged else None,
            "band_reached_batch": t["band_reached_batch"],
            "band_reached_after_change": t["band_reached_after_change"],
            "band_reached_fraction": (
                None
                if t["band_reached_batch"] is None or workload_result["epochs"] != 1
                else t["band_reached_batch"] / workload_result["train_batches"]
            ),
            **_hog_configs(workload_result, t),
            "default_over_tuned_time": ratio(default.get("fit_s"), t["fit_s"]),
            "tuned_over_default_steady_samples_per_s": ratio(
                t["steady_samples_per_s"], default.get("steady_samples_per_s")
            ),
            "peak_memory_over_oracle": ratio(t["peak_memory_mb"], oracle["peak_memory_mb"]),
            "steady_peak_memory_over_oracle": ratio(t["steady_peak_memory_mb"], oracle["steady_peak_memory_mb"]),
            "final_config": t["final_config"],
            "oracle_config": oracle["start_config"],
            "excess": excess_breakdown(t, oracle),
        }
    workload_result["tuned"] = tuned
    workload_result["own_loaders"] = {
        START_OF[own]: own_loaders_ratios(workload_result, strategies[own], strategies[mixin], oracle, default)
        for own, mixin in MIXIN_OF.items()
    }
    return workload_result


def own_loaders_ratios(
    workload_result: dict[str, Any],
    own: dict[str, Any],
    mixin: dict[str, Any],
    oracle: dict[str, Any],
    default: dict[str, Any],
) -> dict[str, Any]:
    """The own loaders' tuned fit of one start against the oracle and the mixin's tuned fit of that start.

    A workload whose conditions change is judged on its phase, as the mixin's tuned runs are.
    """
    failed = own.get("error") or oracle.get("error") or mixin.get("error")
    if failed:
        return {"own_over_oracle_time": None, "own_over_mixin_time": None, "error": failed}
    judged = bool(workload_result.get("phase_start"))
    key = "phase_s" if judged else "fit_s"
    return {
        "own_over_oracle_time": ratio(own[key], oracle[key]),
        "own_over_mixin_time": ratio(own[key], mixin[key]),
        "own_over_oracle_fit_time": ratio(own["fit_s"], oracle["fit_s"]),
        "own_over_mixin_fit_time": ratio(own["fit_s"], mixin["fit_s"]),
        "judged": workload_result.get("judged", "the whole fit"),
        "own_s": own[key],
        "mixin_s": mixin[key],
        "oracle_s": oracle[key],
        "default_over_tuned_time": ratio(default.get("fit_s"), own["fit_s"]),
        "peak_memory_over_mixin": ratio(own["peak_memory_mb"], mixin["peak_memory_mb"]),
        "final_config": own["final_config"],
        "mixin_final_config": mixin["final_config"],
        "rebuilds": own["rebuilds"],
        "mixin_rebuilds": mixin["rebuilds"],
    }


def _hog_configs(workload_result: dict[str, Any], tuned: dict[str, Any]) -> dict[str, Any]:
    """The config the tuned fit went into the hog's epoch with, and the one it ended on."""
    hog = workload_result.get("hog_epoch")
    configs = tuned.get("next_configs") or []
    if hog is None or not configs or hog < 1 or hog > len(configs):
        return {}
    before, after = configs[hog - 1], configs[-1]
    return {
        "config_before_hog": config_dict(before),
        "config_after_hog": config_dict(after),
        "hog_s": tuned.get("hog_s"),
    }


def _slim(run: dict[str, Any]) -> dict[str, Any]:
    """What the results keep of a run: its spec, times, memory and a few fields per epoch."""
    keep = (
        "fit_s",
        "process_wall_s",
        "load_avg_1m",
        "memory",
        "memory_steady",
        "loader_rebuilds",
        "error",
        "memory_fraction",
        "phase_start",
        "phase_s",
        "band_reached_batch",
        "band_reached_after_change",
        "hog_s",
    )
    out = {k: run[k] for k in keep if k in run}
    out["spec"] = {k: v for k, v in run["spec"].items() if k != "run_id"}
    out["epochs"] = [
        {
            k: e[k]
            for k in (
                "epoch",
                "num_workers",
                "prefetch_factor",
                "samples_per_s",
                "utilization",
                "starvation_ratio",
                "stall_fraction",
                "worker_batch_ms",
                "verdict",
                "changed",
                "wall_s",
                "reason",
            )
        }
        for e in run.get("epochs", [])
    ]
    return out

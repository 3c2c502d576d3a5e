"""Window stats: each field declared once, and pooling, cross-rank reduction and saving follow the declaration."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.history import recall
from lightning_dltune.core.model import PipelineModel
from lightning_dltune.core.policy import decide
from lightning_dltune.core.records import Budget, PolicySettings, Reason, ReasonKind, Verdict, WindowRecord
from lightning_dltune.core.stats import (
    Pool,
    Reduce,
    UtilSource,
    WindowStats,
    from_dict,
    pool_windows,
    reduce_ranks,
    stat,
    tail_wait,
    to_dict,
)
from lightning_dltune.measure.distributed import pack, reduce_across_ranks, unpack
from lightning_dltune.report.words import reason_text


def window(fetch_ms: float, step_ms: float, batches: int = 100, **fields) -> WindowStats:
    return WindowStats(
        batches=batches,
        samples=32 * batches,
        fetch_wait_total_s=fetch_ms / 1e3 * batches,
        step_total_s=step_ms / 1e3 * batches,
        stalls=batches,
        fetches=batches,
        **fields,
    )


def test_every_field_declares_how_it_pools_and_reduces():
    for f in dataclasses.fields(WindowStats):
        assert isinstance(f.metadata.get("pool"), Pool), f.name
        assert isinstance(f.metadata.get("reduce"), Reduce), f.name


def test_pooling_sums_totals_weighs_means_and_keeps_the_latest():
    a = window(10, 10, batches=100, worker_batch_s=0.040, main_cpu_fraction=0.2, fetch_wait_p95_s=0.5)
    b = window(20, 10, batches=300, worker_batch_s=0.080, main_cpu_fraction=0.6, fetch_wait_p95_s=0.1)
    pooled = pool_windows([a, b])
    assert pooled.batches == 400 and pooled.samples == 32 * 400
    assert pooled.fetch_wait_total_s == pytest.approx(1.0 + 6.0)
    assert pooled.worker_batch_s == pytest.approx((0.040 * 100 + 0.080 * 300) / 400)
    assert pooled.main_cpu_fraction == pytest.approx((0.2 * 100 + 0.6 * 300) / 400)
    assert pooled.fetch_wait_p95_s == 0.1  # a percentile of the latest window


def test_a_pooled_history_keeps_the_training_process_cpu_share():
    # the model's CPU limit from two pooled windows of one config must match the one from a single window
    # (pooling once dropped main_cpu_fraction, and from the second window on the model assumed a whole core)
    settings, budget = PolicySettings(), Budget(max_workers=32, cpus=4)
    one = window(30, 10, worker_batch_s=0.080, worker_cpu_fraction=1.0, main_cpu_fraction=0.3)
    config = LoaderConfig(num_workers=1)
    single = PipelineModel.infer(1, one, budget.cpus)
    history = [WindowRecord(0, config, one, Verdict.DATA_BOUND_CPU, Reason(ReasonKind.NOTE), config)]
    pooled = recall(history, config, one, budget, settings).seen
    assert pooled.main_cpu_fraction == pytest.approx(0.3)
    assert PipelineModel.infer(1, pooled, budget.cpus).cpu_limit() == single.cpu_limit() == 4


def test_ranks_reduce_to_the_most_starved_rank_with_every_rank_samples():
    fast = window(1, 10, gpu_util=0.9, util_source=UtilSource.NVML, main_cpu_fraction=0.2, worker_batch_s=0.01)
    slow = window(9, 10, gpu_util=0.6, util_source=UtilSource.NVML, main_cpu_fraction=0.1, worker_batch_s=0.05)
    job = reduce_ranks([fast, slow])
    assert job.fetch_wait_total_s == slow.fetch_wait_total_s and job.worker_batch_s == 0.05
    assert job.samples == fast.samples + slow.samples
    assert job.gpu_util == 0.6 and job.util_source == UtilSource.NVML
    assert job.main_cpu_fraction == 0.2
    # one rank without NVML makes the job's utilization an estimate
    no_nvml = dataclasses.replace(fast, gpu_util=None, util_source=UtilSource.ESTIMATE)
    job = reduce_ranks([no_nvml, slow])
    assert job.gpu_util is None and job.util_source == UtilSource.ESTIMATE


def test_rows_pack_and_unpack_through_a_gathered_tensor():
    ranks = [window(1, 10, queue_depth=3.5, batch_bytes=1024), window(5, 10, gpu_util=0.7, util_source="nvml")]
    gathered = torch.stack([pack(s) for s in ranks])  # what gather_rows returns: world_size x fields
    assert gathered.dtype == torch.float64
    assert unpack(WindowStats, gathered) == ranks

    class FakeStrategy:  # rank 0 of 2: the sum all-reduce adds rank 1's slot, its zeros elsewhere
        global_rank = 0

        def reduce(self, block, reduce_op):
            assert reduce_op == "sum" and block[1].eq(0).all()
            return block + torch.stack([torch.zeros_like(block[0]), pack(ranks[1])])

    assert reduce_across_ranks(FakeStrategy(), ranks[0], world_size=2) == reduce_ranks(ranks)
    assert reduce_across_ranks(FakeStrategy(), ranks[0], world_size=1) is ranks[0]


def test_a_field_declared_in_one_place_is_pooled_reduced_and_saved():
    # a new measurement, declared once: summed over windows, the most starved rank's across ranks
    Extended = dataclasses.make_dataclass(
        "Extended",
        [
            ("decode_errors", int, stat(0, Pool.SUM, Reduce.MAX)),
            ("shard_latency_s", Optional[float], stat(None, Pool.MEAN, Reduce.WORST)),
        ],
        bases=(WindowStats,),
        frozen=True,
    )
    a = Extended(**vars(window(2, 10)), decode_errors=1, shard_latency_s=0.010)
    b = Extended(**vars(window(8, 10, batches=300)), decode_errors=2, shard_latency_s=0.030)

    pooled = pool_windows([a, b])
    assert type(pooled) is Extended
    assert pooled.decode_errors == 3 and pooled.shard_latency_s == pytest.approx(0.025)

    rows = [pack(a), pack(b)]
    job = reduce_ranks(unpack(Extended, torch.stack(rows)))
    assert job.decode_errors == 2 and job.shard_latency_s == 0.030  # b is the more starved rank
    assert unpack(Extended, [r.tolist() for r in rows]) == [a, b]  # a list of rows works as well

    saved = to_dict(pooled)
    assert saved["decode_errors"] == 3
    assert from_dict(Extended, saved) == pooled


def test_saved_stats_load_from_older_checkpoints():
    old = {
        "batches": 10,
        "samples": 40,
        "fetch_wait_s": 0.5,
        "step_s": 1.5,
        "util_source": "estimate",
        "dropped_field": 1,
    }
    stats = from_dict(WindowStats, old)
    assert stats.fetch_wait_total_s == 0.5 and stats.step_total_s == 1.5
    assert stats.fetch_wait_s == 0.5 and stats.step_s == 1.5  # the old names still read
    assert stats.starvation_ratio == pytest.approx(0.25)


def test_a_record_round_trips_through_plain_values():
    stats = window(3, 10, gpu_util=0.8, util_source=UtilSource.NVML, main_cpu_fraction=0.4)
    reason = Reason(
        ReasonKind.MORE_WORKERS,
        {
            "starvation": 0.2,
            "windows": 1,
            "workers": 0,
            "batch_s": 0.04,
            "step_s": 0.01,
            "to_workers": 5,
            "prefetch": 2,
            "to_prefetch": 2,
        },
    )
    record = WindowRecord(3, LoaderConfig(), stats, Verdict.DATA_BOUND_IO, reason, LoaderConfig(num_workers=5))
    saved = record.to_dict()
    plain = (int, float, str, bool, type(None), dict, list, tuple)
    assert all(isinstance(v, plain) for v in saved["stats"].values())
    assert isinstance(saved["verdict"], str) and isinstance(saved["reason"], dict)
    assert WindowRecord.from_dict(saved) == record
    # prose reasons of older checkpoints come back as notes that print as they were
    saved["reason"] = "starved 20%: 5 workers"
    assert reason_text(WindowRecord.from_dict(saved).reason) == "starved 20%: 5 workers"


def test_nan_is_unknown_in_rows():
    row = pack(window(1, 10)).tolist()
    names = [f.name for f in dataclasses.fields(WindowStats)]
    assert math.isnan(row[names.index("gpu_util")]) and math.isnan(row[names.index("queue_depth")])


def test_the_workers_p95_time_per_batch_pools_by_batches_reduces_to_the_worst_rank_and_loads_from_old_checkpoints():
    a = window(10, 10, batches=100, worker_batch_s=0.3, worker_batch_p95_s=0.5)
    b = window(20, 10, batches=300, worker_batch_s=0.3, worker_batch_p95_s=0.7)
    assert pool_windows([a, b]).worker_batch_p95_s == pytest.approx((0.5 * 100 + 0.7 * 300) / 400)
    assert pool_windows([a, replace_p95(b, None)]).worker_batch_p95_s is None  # unknown in the latest: unknown
    assert reduce_ranks([a, b]).worker_batch_p95_s == 0.7  # b is the more starved rank
    old = to_dict(a)
    del old["worker_batch_p95_s"]  # a checkpoint from before the field
    assert from_dict(WindowStats, old).worker_batch_p95_s is None


def replace_p95(stats: WindowStats, p95: Optional[float]) -> WindowStats:
    return dataclasses.replace(stats, worker_batch_p95_s=p95)


def test_the_slowest_batch_pools_as_the_largest_and_reduces_to_the_slowest_rank():
    a = window(10, 10, worker_batch_s=0.3, worker_batch_max_s=2.0)
    b = window(20, 10, worker_batch_s=0.3, worker_batch_max_s=0.6)
    assert pool_windows([a, b]).worker_batch_max_s == 2.0  # a tail seen in an earlier window of the config counts
    assert pool_windows([a, dataclasses.replace(b, worker_batch_max_s=None)]).worker_batch_max_s is None
    assert reduce_ranks([b, a]).worker_batch_max_s == 2.0
    old = to_dict(a)
    del old["worker_batch_max_s"]  # a checkpoint from before the field
    assert from_dict(WindowStats, old).worker_batch_max_s is None


def test_stalls_far_longer_than_the_typical_one_are_a_heavy_tail_left_out_of_typical_starvation():
    # four stalls of ~0.3 s and one batch 20x slower that held the loop 24 s
    assert tail_wait([0.3, 24.0, 0.25, 0.35, 0.3]) == 24.0
    assert tail_wait([0.3, 24.0, 0.25, 30.0, 0.3]) == 54.0  # a window can meet two
    assert tail_wait([12.0, 11.0]) == 0.0  # workers delivering in bunches stall alike, however long
    assert tail_wait([24.0]) == 0.0  # one stall alone: nothing to compare it with ...
    assert tail_wait([24.0], batch_s=1.3) == 24.0  # ... but against a batch's making, where it is known
    assert tail_wait([1.2], batch_s=1.3) == 0.0
    # no stall outlasts a batch's making but a slow batch's: long bunches among short hand-overs are no tail
    assert tail_wait([0.01] * 20 + [2.0, 2.2, 2.1], batch_s=2.4) == 0.0
    met_one = WindowStats(
        batches=58, samples=58, fetch_wait_total_s=25.2, step_total_s=5.0, stalls=5, fetches=58, tail_wait_s=24.0
    )
    assert met_one.starvation_ratio > 0.8 and met_one.typical_starvation == pytest.approx(1.2 / 6.2)
    missed_it = dataclasses.replace(met_one, fetch_wait_total_s=1.2, stalls=4, tail_wait_s=0.0)
    assert missed_it.typical_starvation == missed_it.starvation_ratio
    pooled = pool_windows([met_one, missed_it])
    assert pooled.typical_starvation == pytest.approx(2.4 / 12.4)  # pooled windows keep every tail stall apart
    old = to_dict(met_one)
    del old["tail_wait_s"]  # a checkpoint from before the fields
    assert from_dict(WindowStats, old).tail_wait_s == 0.0


def test_the_workers_cost_reduces_to_the_costliest_rank_so_a_rank_whose_data_is_free_cannot_size_the_config():
    # a DDP job whose rank 1 reads 60 ms batches and whose rank 0's are free, both fed by 4 workers: rank 0 can be
    # the more starved one, on taking each batch from a worker alone. Its 0.3 ms batches made the job's cost, and the
    # tuner gave 4 workers back to 0 at 93 % busy (a batch cheaper to make in the loop than to take from a worker),
    # a config that would have starved rank 1 three times over (the 2-process DDP fit, at its last window)
    def fed(fetch_ms: float, batch_s: float, cpu: float) -> WindowStats:
        stats = window(
            fetch_ms, 24, batches=40, worker_batch_s=batch_s, worker_batch_p95_s=batch_s, worker_cpu_fraction=cpu
        )
        return dataclasses.replace(stats, stalls=0, main_cpu_fraction=0.3)

    free, slow = fed(1.9, 0.0003, 0.98), fed(1.3, 0.061, 0.01)
    job = reduce_ranks([free, slow])
    assert job.fetch_wait_total_s == free.fetch_wait_total_s  # the most starved rank holds the others
    assert (job.worker_batch_s, job.worker_batch_p95_s, job.worker_cpu_fraction) == (0.061, 0.061, 0.01)
    four = LoaderConfig(num_workers=4)
    budget = Budget(max_workers=4, cpus=2)
    history = [WindowRecord(0, four, job, Verdict.IN_BAND, Reason(ReasonKind.IN_BAND), four)]
    assert decide(four, job, budget, history).config.num_workers > 0
    # the same job sized from rank 0's cost alone gives them all back
    alone = dataclasses.replace(job, worker_batch_s=0.0003, worker_batch_p95_s=0.0003, worker_cpu_fraction=0.98)
    history = [WindowRecord(0, four, alone, Verdict.IN_BAND, Reason(ReasonKind.IN_BAND), four)]
    assert decide(four, alone, budget, history).config.num_workers == 0

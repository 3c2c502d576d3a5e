"""Ranks in a real 2-process CPU DDP fit (gloo): the slow rank's starvation is the job's, one decision for all."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from tb_events import scalars

pytestmark = pytest.mark.slow  # subprocesses, DDP or real fits

MAX_WORKERS = 4  # the tuner's, in helpers/ddp_user_loaders_fit.py
HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")  # the DDP child scripts


def _run_ddp_script(script, *args):
    """A DDP child script of tests/helpers, run to its end: its output (it must exit 0)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    command = [sys.executable, os.path.join(HELPERS, script), *map(str, args)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    proc = _run_ddp_script("ddp_fit.py", out)
    ranks = [json.load(open(out / f"rank{r}.json")) for r in (0, 1)]
    return out, ranks, proc.stdout + proc.stderr


def test_every_ranks_rows_arrive_exactly_through_one_all_reduce(tmp_path):
    # the looks' and windows' gather: each rank's slot summed with the other's zeros, through Lightning's DDPStrategy
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    _run_ddp_script("ddp_gather_rows.py", tmp_path, port)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    nan, inf = "nan", "inf"
    expected = [[[0.1, 1e-300, -(2.0**60)], [inf, 1 / 3, 5e-324]], [[1.1, nan, -(2.0**61)], [inf, 1 / 3 + 1, 5e-324]]]
    assert ranks[0]["rows"] == ranks[1]["rows"] == expected  # in rank order, every bit as each rank sent it
    # the job's window: the most starved rank's row, every rank's samples
    assert ranks[0]["fetch_wait_total_s"] == ranks[1]["fetch_wait_total_s"] == 1.0
    assert ranks[0]["samples"] == ranks[1]["samples"] == 640


def test_logged_starvation_is_the_slow_ranks(ddp_run):
    out, ranks, _ = ddp_run
    logged = scalars(str(out / "tb"))
    first_epoch_starvation = logged["dltune/starvation_ratio"][0][1]
    # rank 1 waits 60 ms for each batch of a 20 ms step: 0.75; rank 0 never waits on data, so the
    # ranks' mean would be ~0.375 (the first window is the early decision's, 10 batches in)
    assert ranks[0]["history"][0]["num_workers"] == 0
    assert 0.6 <= first_epoch_starvation <= 0.85
    assert ranks[0]["history"][0]["starvation_ratio"] == pytest.approx(first_epoch_starvation)


def test_only_rank_zero_writes(ddp_run):
    out, ranks, output = ddp_run
    event_files = [f for _, _, files in os.walk(out / "tb") for f in files if f.startswith("events.out")]
    assert len(event_files) == 1
    # one console line a window, from rank zero only: ``epoch 1 |`` for a window closed at the epoch's end,
    # ``epoch 1 to batch N |`` for one a look closed early (a busy machine's starvation moves where)
    lines = [line for line in output.splitlines() if re.match(r"\[dltune\] epoch 1( to batch \d+)? \|", line)]
    assert len(lines) == sum(1 for r in ranks[0]["history"] if r["epoch"] == 1) >= 1, lines


def test_every_rank_applies_the_same_decision(ddp_run):
    _, (rank0, rank1), _ = ddp_run
    assert rank0["history"] == rank1["history"]
    assert rank0["final_config"] == rank1["final_config"]
    assert rank0["history"][0]["next_workers"] > 0  # the starved job got workers
    # the train loader runs the final config; the val loader may have got one of its own, alike on both ranks
    assert (
        rank0["live_workers"] == rank1["live_workers"]
        and rank0["live_workers"][0] == rank0["final_config"]["num_workers"]
    )
    # the rebuilt loaders are Lightning's own, with the DistributedSampler it injected
    assert rank0["train_sampler"] == rank1["train_sampler"] == "DistributedSampler"


def test_a_ddp_fit_resumed_mid_epoch_with_another_worker_count_sees_every_remaining_sample_once(tmp_path):
    for phase, workers in (("first", 2), ("resume", 0)):
        _run_ddp_script("ddp_resume_fit.py", tmp_path, phase, workers)
    load = lambda phase, rank: json.load(open(tmp_path / f"{phase}-rank{rank}.json"))  # noqa: E731
    epoch_1 = []
    for rank in (0, 1):
        first, resumed = load("first", rank), load("resume", rank)
        assert resumed["sampler"] == "DistributedSampler"
        assert len(first["train"][1]) == 3 * 4 and len(resumed["train"][0]) == 5 * 4  # 8 batches a rank
        epoch_1 += first["train"][1] + resumed["train"][0]
    assert sorted(epoch_1) == list(range(64))  # both ranks' shards, every sample once


@pytest.fixture(scope="module")
def ddp_user_loaders(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_user")
    _run_ddp_script("ddp_user_loaders_fit.py", out)
    return [json.load(open(out / f"user_rank{r}.json")) for r in (0, 1)]


def test_a_projects_own_loaders_are_tuned_alike_on_every_rank_and_each_sample_trained_once(ddp_user_loaders):
    rank0, rank1 = ddp_user_loaders
    assert rank0["history"] == rank1["history"]  # one decision for all ranks
    assert rank0["history"][0][1] == 0 and rank0["history"][-1][1] > 0  # moved from 0 workers to more
    # Lightning's own re-created loader, with the DistributedSampler it injected, is the one tuned
    assert rank0["first_loader"] == rank1["first_loader"] == ["DataLoader", "DistributedSampler", 0]
    # the last batches ran the last window's config, or its decision where the switch took that over mid-epoch
    assert rank0["last_loader"][2] == rank1["last_loader"][2] in rank0["history"][-1][1:3]
    assert rank0["after_fit"] == rank1["after_fit"] == "DataLoader"
    for epoch in range(2):  # every sample once per epoch across the ranks
        ids = rank0["train_indices"][epoch] + rank1["train_indices"][epoch]
        assert sorted(ids) == list(range(240))
        # every validation sample once per run across the ranks, as Lightning's DistributedSampler deals them:
        # without drop_last it pads 41 samples to 42 by repeating the first, so sample 0 comes again last on rank 1
        val = rank0["val_indices"][epoch] + rank1["val_indices"][epoch]
        assert sorted(val) == sorted([*range(41), 0]) and rank1["val_indices"][epoch][-1] == 0


def test_the_validation_side_gets_one_decision_for_all_ranks(ddp_user_loaders):
    rank0, rank1 = ddp_user_loaders
    # one record per validation run, the same on both ranks: the job's numbers (the most starved rank's), one decision
    assert len(rank0["val_history"]) == 2 and rank0["val_history"] == rank1["val_history"]
    first, second = rank0["val_history"]
    # its 1 ms step starves where training's does not: validation starts with workers of its own (sized from
    # training's first window, on every rank alike) or on the training config, and its own runs add more
    train = {window[2] for window in rank0["history"]}
    assert first[2] in train or first[2] > max(train)
    # more than training ever had, unless training too reached the tuner's max_workers (on a busy host)
    assert second[2] == first[3] and (second[2] > max(train) or second[2] == MAX_WORKERS)
    # each rank's validation loader (Lightning's, with its DistributedSampler) ran the run's config
    ran = [["DataLoader", "DistributedSampler", run[2]] for run in (first, second)]
    assert rank0["val_loaders"] == rank1["val_loaders"] == ran

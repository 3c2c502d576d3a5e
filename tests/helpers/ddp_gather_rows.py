"""Every rank's rows through :func:`~lightning_dltune.measure.distributed.gather_rows` in a 2-process gloo job,
with Lightning's own ``DDPStrategy`` doing the all-reduce; run as a script by tests/test_ddp.py.

Usage: python tests/helpers/ddp_gather_rows.py OUT_DIR PORT
Each rank writes OUT_DIR/rank<N>.json: the gathered rows (``nan`` and ``inf`` as strings) and the job's
stats reduced across ranks.
"""

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from lightning.fabric.plugins.environments import LightningEnvironment  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_dltune.core.stats import WindowStats  # noqa: E402
from lightning_dltune.measure.distributed import gather_rows, reduce_across_ranks  # noqa: E402


def rank_rows(rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows: values any sum but with zeros would round, an unknown, an infinity, a subnormal."""
    return torch.tensor(
        [[0.1 + rank, math.nan if rank else 1e-300, -(2.0**60) * (1 + rank)], [math.inf, 1 / 3 + rank, 5e-324]],
        dtype=torch.float64,
    )


def _text(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def main(rank: int, out_dir: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    environment = LightningEnvironment()
    environment.set_global_rank(rank)
    environment.set_world_size(2)
    strategy = DDPStrategy(cluster_environment=environment)
    gathered = gather_rows(strategy, rank_rows(rank), world_size=2)
    stats = WindowStats(batches=10, fetches=10, fetch_wait_total_s=0.5 * (rank + 1), step_total_s=0.5, samples=320)
    job = reduce_across_ranks(strategy, stats, world_size=2)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        rows = [[[_text(v) for v in row] for row in block] for block in gathered.tolist()]
        json.dump({"rows": rows, "fetch_wait_total_s": job.fetch_wait_total_s, "samples": job.samples}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1], sys.argv[2]), nprocs=2)

"""What one measurement window (an epoch of training batches) looked like: plain numbers, no torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

UTIL_SOURCES = ("nvml", "estimate")


@dataclass(frozen=True)
class WindowStats:
    """Training-batch measurements of one window, already reduced across DDP ranks.

    Sums are over the window's training batches. The first fetch of a window (pipeline fill after
    the loader's iterator starts) is in ``startup_s``, not in ``fetch_wait_s``.

    Args:
        batches: training batches measured (fetch and step both seen).
        samples: samples in those batches.
        fetch_wait_s: Σ fetch wait (loop blocked in ``next()`` on the train loader).
        step_s: Σ step time (``on_train_batch_start`` to ``on_train_batch_end``).
        fetch_wait_p50_s, fetch_wait_p95_s, step_p50_s, step_p95_s: per-batch percentiles.
        stalls: fetches that found no ready batch and had to block.
        fetches: fetches measured (the denominator of :attr:`stall_fraction`).
        queue_depth: mean ready batches at request time; ``None`` where the loader cannot say.
        startup_s: time spent starting loader iterators/workers and filling the pipeline.
        worker_batch_s: mean wall time a loader worker took to produce one batch (fetch samples and
            collate), measured inside the workers; ``None`` where the loader cannot say.
        worker_cpu_fraction: CPU time / wall time of that production (near 1: CPU-bound decode;
            near 0: waiting on storage); ``None`` where unknown.
        batch_bytes: bytes of one collated batch (tensors only); ``None`` where unknown.
        gpu_util: mean NVML ``utilization.gpu`` in [0, 1] over the training part; ``None`` without NVML.
        util_source: ``"nvml"`` or ``"estimate"`` (``1 - starvation_ratio``).
        main_cpu_fraction: CPU time of the training process / wall time (batches it made itself not
            counted); the CPUs it leaves are the workers'. ``None`` where unknown.
    """

    batches: int = 0
    samples: int = 0
    fetch_wait_s: float = 0.0
    step_s: float = 0.0
    fetch_wait_p50_s: float = 0.0
    fetch_wait_p95_s: float = 0.0
    step_p50_s: float = 0.0
    step_p95_s: float = 0.0
    stalls: int = 0
    fetches: int = 0
    queue_depth: Optional[float] = None
    startup_s: float = 0.0
    worker_batch_s: Optional[float] = None
    worker_cpu_fraction: Optional[float] = None
    batch_bytes: Optional[int] = None
    gpu_util: Optional[float] = None
    util_source: str = "estimate"
    main_cpu_fraction: Optional[float] = None

    @property
    def busy_s(self) -> float:
        """Σ (fetch wait + step time): the training loop's time on these batches."""
        return self.fetch_wait_s + self.step_s

    @property
    def starvation_ratio(self) -> float:
        """Σ fetch wait / Σ (fetch wait + step time); 0 when nothing was measured."""
        busy = self.busy_s
        return self.fetch_wait_s / busy if busy > 0 else 0.0

    @property
    def utilization(self) -> float:
        """GPU utilization in [0, 1]: NVML where available, else ``1 - starvation_ratio``."""
        if self.util_source == "nvml" and self.gpu_util is not None:
            return self.gpu_util
        return 1.0 - self.starvation_ratio

    @property
    def fetch_wait_mean_s(self) -> float:
        return self.fetch_wait_s / self.batches if self.batches else 0.0

    @property
    def step_mean_s(self) -> float:
        return self.step_s / self.batches if self.batches else 0.0

    @property
    def stall_fraction(self) -> float:
        return self.stalls / self.fetches if self.fetches else 0.0

    @property
    def samples_per_s(self) -> float:
        """Training throughput over the loop's fetch and step time."""
        busy = self.busy_s
        return self.samples / busy if busy > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            starvation_ratio=self.starvation_ratio,
            utilization=self.utilization,
            stall_fraction=self.stall_fraction,
            samples_per_s=self.samples_per_s,
        )
        return out

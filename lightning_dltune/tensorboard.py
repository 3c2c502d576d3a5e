"""The TensorBoard custom-scalars layout: the ``dltune`` panels users open."""

from __future__ import annotations

PREFIX = "dltune/"


def tag(name: str) -> str:
    return PREFIX + name


def custom_scalars_layout() -> dict[str, dict[str, list]]:
    """The layout for :meth:`torch.utils.tensorboard.SummaryWriter.add_custom_scalars`.

    One ``dltune`` category; a margin chart draws utilization between the band's edges.
    """
    return {
        "dltune": {
            "GPU utilization vs band": ["Margin", [tag("gpu_util"), tag("band_low"), tag("band_high")]],
            "starvation ratio": ["Multiline", [tag("starvation_ratio")]],
            "fetch wait vs step time (ms)": [
                "Multiline",
                [tag("fetch_wait_ms"), tag("step_ms"), tag("fetch_wait_p95_ms"), tag("step_p95_ms")],
            ],
            "stalls and queue depth": ["Multiline", [tag("stalls"), tag("stall_fraction"), tag("queue_depth")]],
            "throughput (samples/s)": ["Multiline", [tag("samples_per_s")]],
            "loader config": ["Multiline", [tag("num_workers"), tag("prefetch_factor"), tag("rebuilds")]],
            "worker cost and start-up (ms)": ["Multiline", [tag("worker_batch_ms"), tag("startup_ms")]],
            "per step": [
                "Multiline",
                [tag("step/starvation_ratio"), tag("step/fetch_wait_ms"), tag("step/step_ms"), tag("step/stalls")],
            ],
        }
    }


def layout_tags() -> list[str]:
    """Every scalar tag the layout refers to."""
    return [t for chart in custom_scalars_layout()["dltune"].values() for t in chart[1]]

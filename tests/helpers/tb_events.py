"""Read TensorBoard event files back with tensorboard's own reader."""

from __future__ import annotations

import glob
import os

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2


def accumulator(log_dir: str) -> EventAccumulator:
    files = glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)
    assert files, f"no event files under {log_dir}"
    ea = EventAccumulator(os.path.dirname(files[0]), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    ea = accumulator(log_dir)
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


def layout(log_dir: str) -> layout_pb2.Layout:
    ea = accumulator(log_dir)
    event = ea.Tensors("custom_scalars__config__")[0]
    parsed = layout_pb2.Layout()
    parsed.ParseFromString(event.tensor_proto.string_val[0])
    return parsed


def texts(log_dir: str, tag: str = "dltune/decision/text_summary") -> list[str]:
    ea = accumulator(log_dir)
    return [e.tensor_proto.string_val[0].decode() for e in ea.Tensors(tag)]

"""probe: what one step's batch holds (samples and bytes), for one train loader or several combined."""

from collections import namedtuple

import torch

from lightning_dltune.measure.probe import batch_size_and_bytes, step_size_and_bytes

Pair = namedtuple("Pair", ["x", "y"])


def test_batch_size_is_the_first_tensors_leading_dimension_and_bytes_count_every_tensor():
    batch = {"x": torch.zeros(8, 3), "y": torch.zeros(8, dtype=torch.int64), "name": ["a"] * 8}
    assert batch_size_and_bytes(batch) == (8, 8 * 3 * 4 + 8 * 8)
    assert batch_size_and_bytes(Pair(torch.zeros(5, 2), torch.zeros(5))) == (5, 5 * 2 * 4 + 5 * 4)


def test_a_step_over_several_loaders_counts_every_loaders_batch():
    batch = {"a": {"x": torch.zeros(4, 2)}, "b": {"x": torch.zeros(6, 2)}}
    assert step_size_and_bytes(batch, loaders_per_step=2) == (10, 10 * 2 * 4)
    assert step_size_and_bytes([torch.zeros(4), torch.zeros(6)], loaders_per_step=2) == (10, 40)
    assert step_size_and_bytes(batch, loaders_per_step=1) == (4, 10 * 2 * 4)  # one loader's dict batch

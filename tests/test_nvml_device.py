"""NVML's return shapes and errors as the sampler reads them, against pynvml's own types."""

from __future__ import annotations

import types

import pytest

from lightning_dltune.nvml.device import describe_nvml_error, parse_device, read_utilization_samples

pynvml = pytest.importorskip("pynvml")


def _sample(ts: int, **value) -> pynvml.c_nvmlSample_t:
    sample = pynvml.c_nvmlSample_t()
    sample.timeStamp = ts
    for field, v in value.items():
        setattr(sample.sampleValue, field, v)
    return sample


def _nvml(answer):
    def get_samples(handle, sample_type, cursor):
        if isinstance(answer, Exception):
            raise answer
        return answer

    return types.SimpleNamespace(nvmlDeviceGetSamples=get_samples, NVML_ERROR_NOT_FOUND=pynvml.NVML_ERROR_NOT_FOUND)


def test_samples_are_read_from_the_union_field_their_value_type_names_oldest_first():
    unsigned = (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, [_sample(30, uiVal=80), _sample(20, uiVal=40)])
    assert read_utilization_samples(_nvml(unsigned), None, 1, cursor_us=0) == [(20, 0.4), (30, 0.8)]
    double = (pynvml.NVML_VALUE_TYPE_DOUBLE, [_sample(30, dVal=55.0)])
    assert read_utilization_samples(_nvml(double), None, 1, cursor_us=0) == [(30, 0.55)]


def test_samples_at_or_before_the_cursor_are_not_returned_again():
    answer = (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, [_sample(10, uiVal=1), _sample(20, uiVal=2), _sample(30, uiVal=3)])
    assert [ts for ts, _ in read_utilization_samples(_nvml(answer), None, 1, cursor_us=20)] == [30]


def test_not_found_is_no_new_sample_and_other_errors_are_raised():
    assert read_utilization_samples(_nvml(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)), None, 1, 0) == []
    assert read_utilization_samples(_nvml((pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, [])), None, 1, 0) == []
    with pytest.raises(pynvml.NVMLError) as err:
        read_utilization_samples(_nvml(pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)), None, 1, 0)
    assert describe_nvml_error(err.value) == f"Timeout (NVML error {pynvml.NVML_ERROR_TIMEOUT})"


def test_describe_names_non_nvml_errors_by_type():
    assert describe_nvml_error(RuntimeError("boom")) == "RuntimeError: boom"


@pytest.mark.parametrize("device, expected", [(None, (None, None)), ("cuda:1", ("cuda", 1)), ("cpu", ("cpu", None))])
def test_parse_device_accepts_devices_strings_and_none(device, expected):
    assert parse_device(device) == expected


def test_parse_device_rejects_other_values_naming_the_argument():
    with pytest.raises(ValueError, match="`device` must be"):
        parse_device(3)

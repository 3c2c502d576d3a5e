"""GPU utilization from NVML: which device this rank trains on, the sampler, time-weighted means."""

"""Loaders the tuner can change: the instrumented DataLoader, the switch to a new config, torch's internals."""

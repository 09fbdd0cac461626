"""Timings and memory of minimoe against its peers: ``python -m benchmarks [--quick]``."""

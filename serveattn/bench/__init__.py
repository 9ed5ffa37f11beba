"""Benchmarks: ``python -m serveattn.bench {prefill,all} [--json PATH] [--quick]``."""

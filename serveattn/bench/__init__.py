"""Benchmarks: ``python -m serveattn.bench {prefill,decode,fp8,verify,crossover,all,plot} ...`` (``--help``
for each)."""

"""The benchmarks (``python -m experiments.bench_*``).

:mod:`.kernels` (decode attention with and without the certificate statistics),
:mod:`.decode` with :mod:`.decode_report` (ms per decode step of the model) and
:mod:`.sharding` (per-device memory and step time on device meshes).
"""

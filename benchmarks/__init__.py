"""Benchmarks of the engine, the server, tensor parallelism and the vision tower, with the random
checkpoints they run on; their results are committed under ``benchmarks/results/``.

Run from the repository root: ``python -m benchmarks.engine``, ``python -m benchmarks.serve``,
``python -m benchmarks.tp``, ``python -m benchmarks.vision``, ``python -m benchmarks.engine_cpu``.
The op benchmarks are the library's own tool: ``python -m portattn.bench``.
"""

"""Throughput benchmarks: the engine's training loop against Keras `fit` and a
minimal hand-written compiled loop, on the same model, data and strategy.

- `python -m benchmarks.throughput`: one configuration, all runners, JSON out.
- `python -m benchmarks.sweep`: steps_per_loop and replica sweeps, PNG + markdown.
- `python -m benchmarks.first_step`: time to the first steps, the engine against `fit`.
- `python -m benchmarks.csv_read`: reading a CSV table, numpy's reader against Python's.
- `fresh_process`: what the last two share (a measurement in a process of its own, the JSON out).
"""

"""Throughput benchmarks: the engine's training loop against Keras `fit` and a
minimal hand-written compiled loop, on the same model, data and strategy.

- `python -m benchmarks.throughput`: one configuration, all runners, JSON out.
- `python -m benchmarks.sweep`: steps_per_loop and replica sweeps, PNG + markdown.
"""

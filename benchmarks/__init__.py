"""Throughput benchmarks: the engine's training loop against Keras `fit` and a
minimal hand-written compiled loop, on the same model, data and strategy.

- `python -m benchmarks.throughput`: one configuration, all runners, JSON out.
- `python -m benchmarks.sweep`: steps_per_loop and replica sweeps, PNG + markdown.
- `python -m benchmarks.first_step`: time to the first steps, the engine against `fit`.
- `python -m benchmarks.csv_read`: reading a CSV table, numpy's reader against Python's.
- `fresh_process`: what the last two share (a measurement in a process of its own, the JSON out).

A benchmark script (`python -m benchmarks.<module>`) starts as the engine's commands do: `engine`
tunes the process (engine/command_start.py) and imports no TensorFlow; a script that measures in
its own process calls `import_tensorflow_lean` (engine/lean_imports.py) before it
touches TensorFlow: TensorFlow and Keras without the optional libraries Keras reaches for (they
stay importable: the sweep draws with matplotlib afterwards), TensorFlow's C++ start-up lines
held back. A script that only starts others (the sweep's parent, `first_step`, `stragglers`)
imports no TensorFlow at all. Figures of a start-up come from fresh processes that import as
their subject does (`first_step`, `start_up_imports`).
"""

"""Throughput benchmarks: the engine's training loop against Keras `fit` and a
minimal hand-written compiled loop, on the same model, data and strategy.

- `python -m benchmarks.throughput`: one configuration, all runners, JSON out.
- `python -m benchmarks.sweep`: steps_per_loop and replica sweeps, PNG + markdown.
- `python -m benchmarks.first_step`: time to the first steps, the engine against `fit`.
- `python -m benchmarks.csv_read`: reading a CSV table, numpy's reader against Python's.
- `fresh_process`: what the last two share (a measurement in a process of its own, the JSON out).

A benchmark script (`python -m benchmarks.<module>`) starts as the engine's commands do
(engine/command_start.py): TensorFlow and Keras imported here, first, without the optional
libraries Keras reaches for (engine/cli/process/lean_imports.py; they stay importable: the sweep
draws with matplotlib afterwards), and its C++ start-up lines held back. Figures of the start-up
itself come from fresh processes that import as their subject does (`first_step`,
`start_up_imports`). Code that imports a benchmark module (the tests) is left as it is.
"""

import sys

import engine  # noqa: F401  (Imports TensorFlow in full, unless this process is a benchmark script.)

if "tensorflow" not in sys.modules:  # A benchmark script: `engine` started it as a command.
    from engine.cli.process.lean_imports import optional_libraries_hidden
    from engine.native_logs import import_tensorflow_quietly

    with optional_libraries_hidden():
        import_tensorflow_quietly()
        import keras  # noqa: F401

"""The command line's process: what a command sets up around a run, before and beside it.

- `preemption`: SIGTERM/SIGINT/SIGHUP, watched before TensorFlow starts its threads;
- `environment`: seeds, determinism, precision;
- `console`: the form of the log lines and which tasks of a cluster print them;
- `own_packages`: the engine's `models`/`input` beside a user's modules of those names;
- `host_memory`: how much memory this process may use.

Its `__init__` imports nothing: `engine.main` imports `preemption` before TensorFlow.
"""

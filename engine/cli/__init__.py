"""The command line: one client of the library, and the only code that knows absl flags.

- `main_command`: the program behind `python -m engine.main` (flags -> RunConfig -> run -> exit code);
- `config/`: a run's settings, from flags and files to a checked `RunConfig` (`settings`,
  `flags`, `cluster_flags`, `flagfiles`, `config_files`, `small_files`, `flag_names`,
  `flag_reference`);
- `run/`: one run from its `RunConfig` (`job`, `assembly`, `run_task`, `evaluator`,
  `predictor`, `hooks_from_flags`, `run_record`, `inputs_record`, `summary`,
  `model_summary`, `hparams`);
- `process/`: what a command sets up around a run (`preemption`,
  `environment`, `console`, `own_packages`, `host_memory`).

The launcher (`python -m engine.launch`, and the task `python -m engine.server` runs) is a
command package of its own beside this one: `engine.launch`.

Research code never needs this package: `import engine` does not import it.
Its `__init__` and its subpackages' import nothing: each command imports what it needs.
"""

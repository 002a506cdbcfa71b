"""The command line: one client of the library, and the only code that knows absl flags.

- `settings` (RunConfig: every flag's type, default and check), `flags`,
  `cluster_flags`, `flagfiles`, `flag_reference` (docs/flags.md);
- `main_command` (`python -m engine.main`), `job` (one run: train, evaluate,
  export), `evaluator` (`--mode=eval` / `continuous_eval`),
  `hooks_from_flags`, `hparams`, `model_summary`, `host_memory`;
- `preemption` (signals), `environment` (seeds, precision), `own_packages`
  (the repository's `models`/`input` beside a user's modules of those names).

The launcher (`python -m engine.launch`, `python -m engine.server`'s task) is a command
package of its own beside this one: `engine.launch`.

Research code never needs this package: `import engine` does not import it.
Its `__init__` imports nothing: each command imports what it needs.
"""

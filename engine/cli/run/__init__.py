"""One run of `engine.main` from its `RunConfig`: train, evaluate, predict, export.

- `job`: a whole run: training (`--mode=train`, `train_and_eval`, `--export_dir`), the
  other modes handed to the evaluator and the predictor;
- `assembly`: the parts built from the settings (devices, precision, seeds, task, optimizer),
  shared by the job and the evaluator;
- `run_task`: the `engine.Task` a run trains (`--task`, or `--model`, `--dataset`, `--loss`);
- `evaluator` (`--mode=eval`, `continuous_eval`), `predictor` (`--mode=predict`);
- `hooks_from_flags`: the built-in hooks the settings ask for;
- what a run records and prints: `run_record` (`metrics.json`), `inputs_record`
  (`inputs.json`), `summary` (the table at the end), `model_summary`, `hparams`.

Its `__init__` imports nothing: each module is imported where it is used.
"""

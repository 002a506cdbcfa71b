"""A run's settings, from the command line and files to a checked `RunConfig`.

- `settings/`: `RunConfig`, composed of sections: every flag's type, default, help and check
  (the one source), and the cluster resolved once per command;
- `flags`, `cluster_flags`: the absl flags `engine.main` and `engine.server` define from it;
- `flagfiles`, `config_files`, `small_files`: `--flagfile`, `--config_file`,
  `--params_override` and `<model_dir>/config.yaml`, read as bounded regular files;
- `flag_names`: the library's messages in the flags' spelling;
- `usage`: what `--help` prints (engine.main and engine.launch): usage, commands, examples, the flags by group;
- `flag_reference`: docs/flags.md, rendered from `RunConfig`, in `usage`'s groups.

Its `__init__` imports nothing: `--help` imports the flags without TensorFlow.
"""

"""What runs inside and around the compiled training loop, below the `Trainer`'s outer loop.

- `steps`: what one replica does for one batch (the train and eval steps,
  `engine.make_train_step`, `engine.call_model`);
- `compiled`: the compiled multi-step loops, the only place that calls `strategy.run`;
- `replica_state`: the BatchNorm statistics each replica keeps, made one value after every loop;
- `runners`: what one training call, one evaluation and one prediction do (`TrainRunner`,
  `EvalRunner`, `PredictRunner`);
- `ps_runners`: their parameter-server forms, run by the coordinator's Trainer (`engine.trainer.coordinated`);
- `iterator_release`: iterators the loop is done with freed off its thread (freeing one can wait);
- `rollback`: surviving a loss spike (`on_nonfinite="rollback"`).

Importing this package imports nothing: each module is imported where it is used.
"""

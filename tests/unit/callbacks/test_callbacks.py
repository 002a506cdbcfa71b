"""User hooks: called between compiled loops, able to stop training, free inside the step.

Covers: engine/callbacks/base.py.
"""

from helpers import global_batches, make_arrays, make_model, make_trainer

import engine
from engine.callbacks import Callback


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, trainer):
        self.events.append(("begin", trainer.step))

    def on_loop_end(self, trainer, step, logs):
        self.events.append(("loop", step))

    def on_eval_end(self, trainer, step, logs):
        self.events.append(("eval", step, logs["num_examples"]))

    def on_train_end(self, trainer, logs):
        self.events.append(("end", trainer.step))


def test_hooks_run_in_order_and_a_plain_callable_can_stop_training(tmp_path, mirrored):
    strategy = mirrored
    x, y = make_arrays(40)
    recorder = Recorder()

    def stop_at_eight(trainer, step, logs):
        if step >= 8:
            trainer.stop_training = True

    model, optimizer = make_model(strategy)
    eval_data = global_batches(x, y, 16).take(2)
    trainer = make_trainer(
        strategy,
        model=model,
        optimizer=optimizer,
        arrays=(x, y),
        eval_data=eval_data,
        cadence=engine.Cadence(eval_every=4, steps_per_loop=4),
        callbacks=[recorder, stop_at_eight],
        model_dir=str(tmp_path),
    )
    trainer.train(100)
    assert trainer.step == 8
    assert recorder.events == [
        ("begin", 0),
        ("loop", 4),
        ("eval", 4, 32),
        ("loop", 8),
        ("eval", 8, 32),
        ("end", 8),
    ]
    assert trainer.checkpoint_manager.latest_checkpoint.endswith("ckpt-8")
    assert trainer.train_loop.experimental_get_tracing_count() == 1

"""engine/checkpointing/checkpointer.py: a checkpoint is never saved with weights that are not
finite, and an unreadable latest checkpoint is refused in one line, or passed over for the
newest readable one with `restore_fallback=True`.
"""

import os

import pytest
from helpers import checkpoint_files, file_tree, small_trainer

from engine.errors import UserError
from engine.options import CheckpointOptions


def test_weights_that_are_not_finite_are_never_saved(tmp_path):
    import tensorflow as tf

    trainer = small_trainer(tmp_path)
    model = trainer.model
    trainer.train(2)
    saved = trainer.checkpoint_manager.latest_checkpoint
    assert saved.endswith("ckpt-2")
    before = checkpoint_files(tmp_path)
    kernel = model.layers[0].kernel
    kernel.assign(tf.tensor_scatter_nd_update(kernel, [[0, 0]], [float("nan")]))
    trainer.global_step.assign(3)
    with pytest.raises(UserError, match="NaN or Inf at step 3; not saved"):
        trainer.save()
    assert trainer.checkpoint_manager.latest_checkpoint == saved
    assert checkpoint_files(tmp_path) == before


def test_restore_fallback_finds_the_newest_readable_checkpoint_when_the_state_names_only_missing_ones(tmp_path):
    import tensorflow as tf

    small_trainer(tmp_path, checkpoint=CheckpointOptions(max_checkpoints=5)).train(6)  # ckpt-2, ckpt-4, ckpt-6
    directory = str(tmp_path / "checkpoints")
    tf.compat.v1.train.update_checkpoint_state(directory, "ckpt-999", all_model_checkpoint_paths=["ckpt-999"])
    before = file_tree(tmp_path)
    with pytest.raises(UserError, match="ckpt-999 cannot be read.*`restore_fallback=True`"):
        small_trainer(tmp_path)
    assert file_tree(tmp_path) == before  # Without the flag, nothing changes.
    trainer = small_trainer(tmp_path, checkpoint=CheckpointOptions(restore_fallback=True))
    assert trainer.step == 6
    assert trainer.checkpoint_manager.latest_checkpoint == os.path.join(directory, "ckpt-6")
    trainer.train(8)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("ckpt-*.index")) == [
        f"ckpt-{step}.index" for step in (2, 4, 6, 8)
    ]

"""TensorBoard event files: one writer a split under `<model_dir>/<split>`,
so that TensorBoard shows train and eval as two runs on the same charts."""

from __future__ import annotations

import os
from collections.abc import Mapping

import tensorflow as tf


class SummaryWriters:
    """Writes scalars for named splits ("train", "eval"), lazily creating writers."""

    def __init__(self, model_dir: str | None):
        self._model_dir = model_dir
        self._writers: dict[str, tf.summary.SummaryWriter] = {}

    def writer(self, split: str) -> tf.summary.SummaryWriter | None:
        """The writer of `split` (None without a model_dir), for summaries beyond scalars."""
        if self._model_dir is None:
            return None
        writer = self._writers.get(split)
        if writer is None:
            writer = tf.summary.create_file_writer(os.path.join(self._model_dir, split))
            self._writers[split] = writer
        return writer

    def write(self, split: str, step: int, scalars: Mapping[str, float]) -> None:
        writer = self.writer(split)
        if writer is None:
            return
        with writer.as_default(step=step):
            for name, value in scalars.items():
                tf.summary.scalar(name, value)
        writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

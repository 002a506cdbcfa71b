"""Files of tf.train.Example records ('image': PNG bytes, 'label': int64): the
way to train on a user's own data set, streamed from disk.

Resuming at step k skips k global batches of raw records (O(k) reads, no
decoding): unlike the in-memory sources, a record's position is not known
without reading the files before it.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from input.errors import DataError
from input.images import fit_images
from input.labels import classes
from input.source import (
    BatchLayout,
    DataSource,
    InputContext,
    deterministic_options,
)

_FEATURES = {
    "image": tf.io.FixedLenFeature([], tf.string),
    "label": tf.io.FixedLenFeature([], tf.int64),
}
_LAYOUT_HELP = (
    "--data_dir must be a directory holding train* (and optionally eval*) files, "
    "or a glob pattern of train files, of tf.train.Example records with 'image' "
    "(PNG bytes) and 'label' (int64); input.write_tfrecords writes such files"
)
SHUFFLE_BLOCK = 4096  # records shuffled together; raw records held in memory
_PARALLEL_READS = 4
# Batches of up to this many records decode in an unrolled graph: building it
# took ~1 s for 64 records, ~5 s for 512 (once, at start-up).
_UNROLL_LIMIT = 128
_HEADER_BYTES = 12  # A record's uint64 length and the uint32 CRC of it.


def write_tfrecords(path: str, images: np.ndarray, labels: np.ndarray) -> None:
    """Write uint8 images (N, H, W, C) and integer labels (N,) as one file of
    PNG-encoded examples that the `tfrecord` source reads."""
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"images must be uint8 of shape (N, H, W, C) with C in 1, 3, 4, got "
            f"{images.dtype} {images.shape}; convert with np.uint8(x * 255)"
        )
    labels = np.asarray(labels)
    if labels.shape != (len(images),) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers of shape ({len(images)},), got {labels.dtype} {labels.shape}")
    parent = os.path.dirname(path)
    if parent:
        tf.io.gfile.makedirs(parent)
    with tf.io.TFRecordWriter(path) as writer:
        for image, label in zip(images, labels, strict=True):
            png = tf.io.encode_png(image).numpy()
            feature = {
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[png])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())


def _find_files(data_dir: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(train files, eval files), each sorted so that file order is fixed."""
    if not data_dir:
        raise DataError(f"--dataset=tfrecord needs --data_dir; {_LAYOUT_HELP}")
    if tf.io.gfile.isdir(data_dir):
        train_pattern = os.path.join(data_dir, "train*")
        eval_files = tuple(sorted(tf.io.gfile.glob(os.path.join(data_dir, "eval*"))))
    else:
        train_pattern, eval_files = data_dir, ()
    train_files = tuple(sorted(tf.io.gfile.glob(train_pattern)))
    if not train_files:
        raise DataError(f"no TFRecord files match {train_pattern!r}; {_LAYOUT_HELP}")
    return train_files, eval_files


class _Parser:
    """A batch of serialized tf.train.Example -> (float32 images at image_shape,
    int32 labels).

    Works on batches, not single records, and decodes a batch without a loop
    where it can: a tf.data element per record costs over three times the CPU
    of the unrolled decode, time the training step gets back
    (benchmarks/RESULTS.md). Every image is decoded on its own, exactly as a single record
    would be, so files may hold images of different sizes.
    """

    def __init__(self, image_shape: tuple[int, int, int], num_classes: int) -> None:
        if image_shape[-1] not in (1, 3, 4):
            raise DataError(
                f"PNG images decode to 1, 3 or 4 channels, not {image_shape[-1]}; "
                "use an image shape with 1 or 3 channels"
            )
        self._image_shape = image_shape
        self._num_classes = num_classes

    def _decode(self, png: tf.Tensor) -> tf.Tensor:
        image = tf.io.decode_png(png, channels=self._image_shape[-1])
        image = tf.image.convert_image_dtype(image, tf.float32)  # uint8 -> [0, 1]
        return fit_images(image, self._image_shape)

    def _decode_all(self, pngs: tf.Tensor) -> tf.Tensor:
        return tf.map_fn(self._decode, pngs, fn_output_signature=tf.TensorSpec(self._image_shape, tf.float32))

    def _decode_unrolled(self, pngs: tf.Tensor, size: int) -> tf.Tensor:
        """A batch of known size: one decode op per image in the graph, no
        loop (map_fn's while loop cost as much CPU as the decoding), when
        every image has the model's size; otherwise `_decode_all`."""
        decoded = [tf.io.decode_png(png, channels=self._image_shape[-1]) for png in tf.unstack(pngs, num=size)]
        sizes = tf.stack([tf.shape(image)[:2] for image in decoded])
        return tf.cond(
            tf.reduce_all(sizes == self._image_shape[:2]),
            lambda: tf.image.convert_image_dtype(
                tf.stack([tf.ensure_shape(image, self._image_shape) for image in decoded]), tf.float32
            ),
            lambda: self._decode_all(pngs),  # Decodes again: files with other sizes pay a resize anyway.
        )

    def __call__(self, records: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        examples = tf.io.parse_example(records, _FEATURES)
        size = examples["image"].shape[0]
        if size is not None and 0 < size <= _UNROLL_LIMIT:
            images = self._decode_unrolled(examples["image"], size)
        else:  # A partial eval batch, or a batch too large for one graph.
            images = self._decode_all(examples["image"])
        labels = examples["label"]
        # An out-of-range label would silently give a NaN or wrong loss later.
        tf.debugging.assert_less(
            labels,
            tf.constant(self._num_classes, tf.int64),
            message=f"tfrecord label >= num_classes={self._num_classes} (pass --num_classes)",
        )
        tf.debugging.assert_non_negative(labels, message="tfrecord label < 0")
        return images, tf.cast(labels, tf.int32)


def _op_error_text(err: tf.errors.OpError) -> str:
    """The human part of a TF error: no '{{function_node ...}}' or '[Op:...]'."""
    text = (err.message or type(err).__name__).splitlines()[0]
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", text)
    return re.sub(r"\s*\[Op:.*$", "", text).strip()


def _check_framing(path: str) -> None:
    """Walks the record headers of a local file (8-byte length, 4-byte CRC, data,
    4-byte CRC) without reading the data: a file cut short (a copy or download
    that stopped) fails here with its name, not at its last record mid-training
    with a DataLossError that names no file. One small read per record."""
    if "://" in path:  # Remote files: reading every header would cost a request each.
        return
    size = os.path.getsize(path)
    offset = 0
    with open(path, "rb") as handle:
        while offset < size:
            handle.seek(offset)
            header = handle.read(_HEADER_BYTES)
            end = offset + _HEADER_BYTES + 4 + (struct.unpack("<Q", header[:8])[0] if len(header) >= 8 else 0)
            if len(header) < _HEADER_BYTES or end > size:
                raise DataError(
                    f"TFRecord file {path} is truncated: its record at byte {offset} ends past the file's "
                    f"{size} bytes; copy the file again or remove it from --data_dir"
                )
            offset = end


def _check_files(files: tuple[str, ...], parser: _Parser) -> None:
    """Parse the first record of every file now, so a wrong --data_dir fails
    at start-up with the file's name, not mid-training inside tf.data."""
    for path in files:
        try:
            first = list(tf.data.TFRecordDataset(path).batch(1).take(1))
            if not first:
                raise DataError(f"TFRecord file {path} is empty; {_LAYOUT_HELP}")
            parser(first[0])
            _check_framing(path)
        except tf.errors.OpError as err:
            message = _op_error_text(err)
            raise DataError(f"cannot read TFRecord file {path}: {message}; {_LAYOUT_HELP}") from None


def _count_records(files: tuple[str, ...]) -> int:
    """Read every record: the engine needs the eval size to report exact
    metrics, and eval splits are small enough to count at start-up."""
    records = tf.data.TFRecordDataset(list(files))
    try:
        return int(records.reduce(tf.constant(0, tf.int64), lambda count, _: count + 1))
    except tf.errors.OpError as err:
        raise DataError(
            f"cannot read eval TFRecord files {', '.join(files)}: {_op_error_text(err)}; {_LAYOUT_HELP}"
        ) from None


@dataclass(frozen=True)
class TFRecordSource(DataSource):
    """TFRecord files; see `load_tfrecord` for the layout on disk."""

    _train_files: tuple[str, ...]
    _eval_files: tuple[str, ...]
    _parser: _Parser = field(repr=False, compare=False)

    @property
    def feature_dtype(self) -> str:
        return "uint8"  # Decoded PNG pixels.

    def _epoch_records(
        self, seed: int, files: tuple[str, ...], shard: tuple[int, int]
    ) -> Callable[[tf.Tensor], tf.data.Dataset]:
        """flat_map function: raw records of one epoch in seeded order.

        Files are permuted per epoch, then records are shuffled in blocks of
        SHUFFLE_BLOCK with a seed derived from (seed, epoch, block): all
        stateless, unlike Dataset.shuffle, whose order also depends on the
        global TF seed.
        """
        num_shards, shard_index = shard
        file_names = tf.constant(files)

        def records(epoch: tf.Tensor) -> tf.data.Dataset:
            epoch_seed = tf.stack([tf.constant(seed, tf.int64), epoch])
            order = tf.random.experimental.stateless_shuffle(tf.range(len(files)), seed=epoch_seed)
            epoch_files = tf.gather(file_names, order)[shard_index::num_shards]

            def shuffle_block(block_index: tf.Tensor, block: tf.Tensor) -> tf.Tensor:
                block_seed = tf.random.experimental.stateless_fold_in(epoch_seed, block_index)
                positions = tf.random.experimental.stateless_shuffle(
                    tf.range(tf.shape(block)[0]), seed=block_seed
                )
                return tf.gather(block, positions)

            return (
                tf.data.TFRecordDataset(epoch_files, num_parallel_reads=_PARALLEL_READS)
                .batch(SHUFFLE_BLOCK)
                .enumerate()
                .map(shuffle_block)
                .unbatch()
            )

        return records

    def _train_stream(
        self, layout: BatchLayout, *, seed: int, start_step: int, input_context: InputContext | None
    ) -> tf.data.Dataset:
        """See DataSource.train_dataset. With several input pipelines and at least as many
        files, each pipeline reads its own files (per epoch, file i of the
        shuffled list goes to pipeline i mod P) and batches them itself, so the
        global batch is not the one a single pipeline would make; with fewer
        files, every pipeline reads all records and keeps its slice of each
        global batch (the exact per-replica contract, at P times the reads)."""
        global_batch_size = layout.global_batch_size
        pipelines = 1 if input_context is None else input_context.num_input_pipelines
        shard_files = pipelines > 1 and len(self._train_files) >= pipelines
        shard = (1, 0)
        if input_context is not None and shard_files:
            shard = (pipelines, input_context.input_pipeline_id)
        records = tf.data.Dataset.counter(dtype=tf.int64).flat_map(
            self._epoch_records(seed, self._train_files, shard)
        )
        # Batches of raw records first, parsed a batch at a time (see _Parser).
        if shard_files:
            batches = records.skip(start_step * layout.examples_per_step).batch(
                layout.per_replica, drop_remainder=True
            )
        else:
            batches = records.skip(start_step * global_batch_size).batch(global_batch_size, drop_remainder=True)
            if input_context is not None:  # Only this pipeline's records get decoded.
                batches = batches.map(self._own_replicas(layout)).unbatch()
        return (
            batches.map(self._parser, num_parallel_calls=tf.data.AUTOTUNE)
            .prefetch(tf.data.AUTOTUNE)
            .with_options(deterministic_options())
        )

    @staticmethod
    def _own_replicas(layout: BatchLayout) -> Callable[[tf.Tensor], tf.Tensor]:
        """Global batch of records -> this pipeline's per-replica batches, stacked."""
        start, end = layout.offset, layout.offset + layout.examples_per_step

        def slice_batch(records: tf.Tensor) -> tf.Tensor:
            return tf.reshape(records[start:end], [layout.replicas_per_pipeline, layout.per_replica])

        return slice_batch

    def damaged_files(self, error_text: str) -> tuple[str, ...]:
        """The files that may hold the damaged record a DataLossError of the reader
        reports ("corrupted record at 9352" names an offset, not a file): the file its
        text names, else the train files long enough to hold that offset (remote ones
        kept: their size costs a request), else every train file. Eval files were read
        whole at start-up (`_count_records`), so damage found mid-run is the train split's."""
        files = self._train_files + self._eval_files
        named = tuple(path for path in files if path in error_text)
        if named:
            return named
        offset = re.search(r"record at (\d+)", error_text)
        if offset is None:
            return self._train_files
        holding = tuple(
            path
            for path in self._train_files
            if "://" in path or not os.path.exists(path) or os.path.getsize(path) > int(offset.group(1))
        )
        return holding or self._train_files

    def _eval_batches(self, layout: BatchLayout, input_context: InputContext | None) -> tf.data.Dataset:
        records = tf.data.TFRecordDataset(list(self._eval_files))
        if input_context is not None:
            records = records.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return (
            records.batch(layout.per_replica, drop_remainder=False)
            .map(self._parser, num_parallel_calls=tf.data.AUTOTUNE)
            .prefetch(tf.data.AUTOTUNE)
            .with_options(deterministic_options())
        )


def load_tfrecord(
    image_shape: tuple[int, int, int] | None, num_classes: int | None, data_dir: str | None
) -> TFRecordSource:
    """Check the files named by --data_dir; count the eval records (train
    files are not counted: that would read the whole data set).

    Images are served at `image_shape`, else at the first train record's own
    size and channels (records of another size are resized to it); the
    classes are `num_classes`, else the largest label + 1 of the eval
    records (or, without eval files, of the first train file): a larger
    label met later stops the run with a line asking for --num_classes.
    """
    train_files, eval_files = _find_files(data_dir)
    if image_shape is None:
        image_shape = _first_image_shape(train_files[0])
    # Every file readable first (its first record decoded), whatever the number of classes.
    _check_files(train_files + eval_files, _Parser(image_shape, np.iinfo(np.int64).max))
    if num_classes is None:
        num_classes = _largest_label(eval_files or train_files[:1]) + 1
    parser = _Parser(image_shape, num_classes)
    return TFRecordSource(
        name="tfrecord",
        labels=classes(max(num_classes, 2)),
        feature_shape=image_shape,
        num_train_examples=None,
        num_eval_examples=_count_records(eval_files) if eval_files else None,
        _train_files=train_files,
        _eval_files=eval_files,
        _parser=parser,
    )


def _first_image_shape(path: str) -> tuple[int, int, int]:
    """(H, W, C) of the first record's PNG, as stored."""
    try:
        for record in tf.data.TFRecordDataset(path).take(1):
            example = tf.io.parse_single_example(record, _FEATURES)
            height, width, channels = (int(d) for d in tf.io.decode_png(example["image"]).shape)
            return height, width, channels
    except tf.errors.OpError as err:
        raise DataError(f"cannot read TFRecord file {path}: {_op_error_text(err)}; {_LAYOUT_HELP}") from None
    raise DataError(f"TFRecord file {path} is empty; {_LAYOUT_HELP}")


def _largest_label(files: tuple[str, ...]) -> int:
    """The largest label of the (small) eval files, read once at start-up."""
    records = tf.data.TFRecordDataset(list(files)).batch(1024)
    largest = -1
    try:
        for batch in records:
            labels = tf.io.parse_example(batch, {"label": _FEATURES["label"]})["label"]
            largest = max(largest, int(tf.reduce_max(labels)))
    except tf.errors.OpError as err:
        raise DataError(
            f"cannot read eval TFRecord files {', '.join(files)}: {_op_error_text(err)}; {_LAYOUT_HELP}"
        ) from None
    return largest

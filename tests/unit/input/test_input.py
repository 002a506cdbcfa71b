"""Input pipelines: exact resume, per-replica slicing, eval coverage, and
one-line DataErrors for missing or broken data."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

from input import DataError, DataSource, dataset_names, get_data_source, write_tfrecords

MNIST_SHAPE = (28, 28, 1)


@pytest.fixture(scope="module")
def digits() -> DataSource:
    return get_data_source("digits", image_shape=MNIST_SHAPE)


@pytest.fixture(scope="module")
def synthetic() -> DataSource:
    return get_data_source("synthetic", image_shape=(8, 8, 1))


def take(dataset: tf.data.Dataset, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(x.numpy(), y.numpy()) for x, y in dataset.take(count)]


def context(pipelines: int, pipeline_id: int, replicas: int) -> tf.distribute.InputContext:
    return tf.distribute.InputContext(
        num_input_pipelines=pipelines,
        input_pipeline_id=pipeline_id,
        num_replicas_in_sync=replicas,
    )


def assert_same_batches(actual, expected) -> None:
    assert len(actual) == len(expected)
    for (x, y), (ex, ey) in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


def rows(images: np.ndarray) -> list[bytes]:
    """Hashable identity of each image, to compare example sets."""
    return [image.tobytes() for image in images]


# --- digits -------------------------------------------------------------------


def test_digits_split_sizes_values_and_labels(digits: DataSource) -> None:
    assert (digits.num_train_examples, digits.num_eval_examples) == (1500, 297)
    assert (digits.num_classes, digits.feature_shape) == (10, MNIST_SHAPE)
    images, labels = take(digits.train_dataset(global_batch_size=500, seed=0), 1)[0]
    assert images.shape == (500, 28, 28, 1) and images.dtype == np.float32
    assert labels.shape == (500,) and labels.dtype == np.int32
    assert images.min() == 0.0 and images.max() == 1.0
    assert set(labels) == set(range(10))


@pytest.mark.parametrize("where", ["its file", "load_digits"])
def test_digits_are_scikit_learns_whether_read_from_its_file_or_through_load_digits(where, monkeypatch) -> None:
    from sklearn.datasets import load_digits

    from input import digits as digits_module

    if where == "load_digits":  # A scikit-learn that keeps the file elsewhere.
        monkeypatch.setattr(digits_module.importlib.util, "find_spec", lambda name: None)
    pixels, labels = digits_module._digits_table()
    reference = load_digits()
    np.testing.assert_array_equal(pixels, reference.data)
    np.testing.assert_array_equal(labels, reference.target)
    assert pixels.shape == (1797, 64)


def test_digits_resized_to_other_shapes_with_repeated_channels() -> None:
    source = get_data_source("digits", image_shape=(8, 8, 3))
    images, _ = take(source.eval_dataset(global_batch_size=4), 1)[0]
    assert images.shape == (4, 8, 8, 3)
    np.testing.assert_array_equal(images[..., 0], images[..., 2])
    # At the native 8x8 size the pixels are the original 0..16 values / 16.
    np.testing.assert_array_equal(np.round(images * 16), images * 16)


# --- exact resume and seeds -----------------------------------------------------


def test_resume_at_step_k_crosses_epoch_boundary_exactly(digits: DataSource) -> None:
    # 1,500 examples / 64 per batch: epoch 1 starts inside step 23.
    full = take(digits.train_dataset(global_batch_size=64, seed=7), 28)
    resumed = take(digits.train_dataset(global_batch_size=64, seed=7, start_step=20), 8)
    assert_same_batches(resumed, full[20:28])


def test_same_seed_same_stream_other_seed_other_order(digits: DataSource) -> None:
    first = take(digits.train_dataset(global_batch_size=32, seed=1), 3)
    again = take(digits.train_dataset(global_batch_size=32, seed=1), 3)
    other = take(digits.train_dataset(global_batch_size=32, seed=2), 3)
    assert_same_batches(again, first)
    assert not np.array_equal(first[0][0], other[0][0])


def test_each_epoch_is_a_new_permutation_of_all_examples(synthetic: DataSource) -> None:
    # 1,024 distinct random images, 4 batches of 256 per epoch.
    batches = take(synthetic.train_dataset(global_batch_size=256, seed=3), 8)
    epoch0 = rows(np.concatenate([x for x, _ in batches[:4]]))
    epoch1 = rows(np.concatenate([x for x, _ in batches[4:]]))
    assert len(set(epoch0)) == 1024
    assert set(epoch0) == set(epoch1)
    assert epoch0 != epoch1


@pytest.mark.timeout(60)
def test_resume_far_ahead_is_o1(digits: DataSource) -> None:
    # Step 10**9 is ~4e7 epochs in: replaying would never finish.
    dataset = digits.train_dataset(global_batch_size=64, seed=1, start_step=10**9)
    ((images, labels),) = take(dataset, 1)
    assert images.shape == (64, 28, 28, 1) and labels.shape == (64,)


# --- per-replica slicing ----------------------------------------------------------


@pytest.mark.parametrize("replicas", [2, 4])
def test_one_pipeline_yields_slices_of_the_global_batch(digits: DataSource, replicas: int) -> None:
    global_batches = take(digits.train_dataset(global_batch_size=64, seed=5, start_step=21), 4)
    per_replica = take(
        digits.train_dataset(
            global_batch_size=64,
            seed=5,
            start_step=21,
            input_context=context(1, 0, replicas),
        ),
        4 * replicas,
    )
    assert all(x.shape[0] == 64 // replicas for x, _ in per_replica)
    for step, (images, labels) in enumerate(global_batches):
        step_slices = per_replica[step * replicas : (step + 1) * replicas]
        np.testing.assert_array_equal(np.concatenate([x for x, _ in step_slices]), images)
        np.testing.assert_array_equal(np.concatenate([y for _, y in step_slices]), labels)


def test_two_pipelines_interleave_back_to_the_global_batch(digits: DataSource) -> None:
    # 4 replicas, 2 per pipeline: pipeline 0 owns slices 0-1, pipeline 1 slices 2-3.
    global_batches = take(digits.train_dataset(global_batch_size=64, seed=5, start_step=22), 3)
    pipelines = [
        take(
            digits.train_dataset(global_batch_size=64, seed=5, start_step=22, input_context=context(2, p, 4)),
            6,
        )
        for p in range(2)
    ]
    for step, (images, _) in enumerate(global_batches):
        slices = [b for p in range(2) for b in pipelines[p][2 * step : 2 * step + 2]]
        np.testing.assert_array_equal(np.concatenate([x for x, _ in slices]), images)


def test_batch_not_divisible_by_replicas_is_refused(digits: DataSource) -> None:
    with pytest.raises(ValueError, match="global_batch_size 30 is not divisible by the 4"):
        digits.train_dataset(global_batch_size=30, seed=0, input_context=context(1, 0, 4))


# --- eval -----------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [32, 64])
def test_eval_covers_every_example_once_with_partial_last_batch(digits: DataSource, batch_size: int) -> None:
    batches = take(digits.eval_dataset(global_batch_size=batch_size), -1)
    sizes = [len(y) for _, y in batches]
    assert sizes == [batch_size] * (297 // batch_size) + [297 % batch_size]
    labels = np.concatenate([y for _, y in batches])
    images = np.concatenate([x for x, _ in batches])
    # Fixed order: a second pass is identical.
    assert_same_batches(take(digits.eval_dataset(global_batch_size=batch_size), -1), batches)

    shards = [
        take(
            digits.eval_dataset(global_batch_size=batch_size, input_context=context(2, p, 2)),
            -1,
        )
        for p in range(2)
    ]
    for shard in shards:  # per-replica batches, last one partial
        assert all(len(y) == batch_size // 2 for _, y in shard[:-1])
        assert 0 < len(shard[-1][1]) <= batch_size // 2
    shard_images = np.concatenate([x for shard in shards for x, _ in shard])
    shard_labels = np.concatenate([y for shard in shards for _, y in shard])
    assert len(shard_labels) == 297
    assert shard_labels.sum() == labels.sum()
    assert sorted(rows(shard_images)) == sorted(rows(images))


def test_eval_split_is_independent_of_train_stream(digits: DataSource) -> None:
    eval_rows = set(rows(take(digits.eval_dataset(global_batch_size=297), 1)[0][0]))
    train_rows = set(rows(take(digits.train_dataset(global_batch_size=1500, seed=0), 1)[0][0]))
    assert len(eval_rows) > 290 and len(train_rows) > 1400  # a few digits repeat
    # Overlap only where the same 8x8 image occurs in both halves (rare duplicates).
    assert len(eval_rows & train_rows) < 5


# --- mnist ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "features, labels, said",
    [
        (np.zeros((4, 0), np.float32), np.arange(4) % 2, "features of shape (4, 0) hold no values an example"),
        (np.ones((4, 2), np.complex64), np.arange(4) % 2, "features are complex (complex64)"),
        (np.ones((4, 2), np.float32), np.zeros((4, 0), np.float32), "labels of shape (4, 0) hold no value"),
        (np.ones((4, 2), np.float32), np.ones(4, np.complex64), "labels must be real numbers, got complex64"),
    ],
    ids=["no feature values", "complex features", "no label values", "complex labels"],
)
def test_arrays_of_any_source_without_values_or_of_complex_numbers_are_refused(features, labels, said) -> None:
    """What every in-memory source goes through (a data function's datasets, tfds, files):
    (N, 0) features aborted the process inside oneDNN, complex ones trained as their real part."""
    from input.arrays import source_from_arrays

    with pytest.raises(DataError) as refused:
        source_from_arrays("mine", (features, labels), None)
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_mnist_missing_offline_names_the_alternatives(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KERAS_HOME", raising=False)
    with pytest.raises(DataError) as error:
        get_data_source("mnist", image_shape=MNIST_SHAPE)
    message = str(error.value)
    assert "\n" not in message
    assert os.path.join(str(tmp_path), ".keras", "datasets") in message
    assert "--dataset=digits" in message and "--dataset=synthetic" in message


def test_mnist_loads_a_local_npz_from_data_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    rng = np.random.RandomState(0)
    arrays = {
        "x_train": rng.randint(0, 256, (50, 28, 28), dtype=np.uint8),
        "y_train": rng.randint(0, 10, 50).astype(np.uint8),
        "x_test": rng.randint(0, 256, (20, 28, 28), dtype=np.uint8),
        "y_test": rng.randint(0, 10, 20).astype(np.uint8),
    }
    np.savez(tmp_path / "mnist.npz", **arrays)
    source = get_data_source("mnist", image_shape=MNIST_SHAPE, data_dir=str(tmp_path))
    assert (source.num_train_examples, source.num_eval_examples) == (50, 20)
    ((images, labels),) = take(source.eval_dataset(global_batch_size=20), 1)
    np.testing.assert_array_equal(images[..., 0], arrays["x_test"] / np.float32(255))
    np.testing.assert_array_equal(labels, arrays["y_test"])


def _mnist_npz(path) -> None:
    rng = np.random.RandomState(0)
    np.savez(
        path,
        x_train=rng.randint(0, 256, (50, 28, 28), dtype=np.uint8),
        y_train=rng.randint(0, 10, 50).astype(np.uint8),
        x_test=rng.randint(0, 256, (20, 28, 28), dtype=np.uint8),
        y_test=rng.randint(0, 10, 20).astype(np.uint8),
    )


@pytest.mark.parametrize(
    "damage,kind", [("empty", "EOFError"), ("not_a_zip", "BadZipFile"), ("cut_in_half", "BadZipFile")]
)
def test_a_damaged_mnist_npz_is_one_line_naming_it(tmp_path, monkeypatch, damage, kind) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "mnist.npz"
    _mnist_npz(path)
    data = path.read_bytes()
    path.write_bytes(
        {"empty": b"", "not_a_zip": b"PK\x03\x04" + data[-100:], "cut_in_half": data[: len(data) // 2]}[damage]
    )
    with pytest.raises(DataError) as error:
        get_data_source("mnist", image_shape=MNIST_SHAPE, data_dir=str(tmp_path))
    assert str(error.value).startswith(f"cannot read MNIST from {path}: {kind}")
    assert "copy it again or remove it" in str(error.value) and "\n" not in str(error.value)


# --- tfrecord -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory) -> tuple[str, np.ndarray, np.ndarray]:
    """train-0 (40), train-1 (40), eval-0 (20) of distinct 8x8 gray images."""
    directory = tmp_path_factory.mktemp("records")
    images = np.random.RandomState(0).randint(0, 256, (100, 8, 8, 1), dtype=np.uint8)
    labels = np.arange(100) % 10
    write_tfrecords(str(directory / "train-0"), images[:40], labels[:40])
    write_tfrecords(str(directory / "train-1"), images[40:80], labels[40:80])
    write_tfrecords(str(directory / "eval-0"), images[80:], labels[80:])
    return str(directory), images, labels


def as_uint8(images: np.ndarray) -> np.ndarray:
    return np.round(images * 255).astype(np.uint8)


def test_tfrecord_round_trip(record_dir) -> None:
    directory, images, labels = record_dir
    source = get_data_source("tfrecord", image_shape=(8, 8, 1), data_dir=directory)
    assert (source.num_train_examples, source.num_eval_examples) == (None, 20)

    evals = take(source.eval_dataset(global_batch_size=8), -1)
    assert [len(y) for _, y in evals] == [8, 8, 4]
    np.testing.assert_array_equal(as_uint8(np.concatenate([x for x, _ in evals])), images[80:])
    np.testing.assert_array_equal(np.concatenate([y for _, y in evals]), labels[80:])

    train = take(source.train_dataset(global_batch_size=16, seed=1), 10)
    epoch0 = as_uint8(np.concatenate([x for x, _ in train[:5]]))  # 80 examples
    assert sorted(rows(epoch0)) == sorted(rows(images[:80]))
    assert not np.array_equal(epoch0, images[:80])  # shuffled
    # Resume (by skipping records) gives the same batches.
    assert_same_batches(take(source.train_dataset(global_batch_size=16, seed=1, start_step=4), 6), train[4:])
    # One pipeline, 2 replicas: consecutive halves of each global batch.
    halves = take(source.train_dataset(global_batch_size=16, seed=1, input_context=context(1, 0, 2)), 6)
    for step in range(3):
        np.testing.assert_array_equal(
            np.concatenate([halves[2 * step][0], halves[2 * step + 1][0]]), train[step][0]
        )


def test_tfrecord_pipelines_shard_files_when_there_are_enough(record_dir) -> None:
    directory, images, _ = record_dir
    source = get_data_source("tfrecord", image_shape=(8, 8, 1), data_dir=directory)
    seen = []
    for p in range(2):
        batches = take(
            source.train_dataset(global_batch_size=16, seed=1, input_context=context(2, p, 2)),
            5,  # 40 examples: one epoch of this pipeline's one file
        )
        assert all(x.shape == (8, 8, 8, 1) for x, _ in batches)
        seen.append(set(rows(as_uint8(np.concatenate([x for x, _ in batches])))))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(rows(images[:80]))


@pytest.mark.parametrize("sides", [(8, 8, 8), (8, 12, 6)], ids=["model_size", "mixed_sizes"])
def test_tfrecord_batches_hold_each_record_decoded_alone(tmp_path, sides) -> None:
    """Records are parsed a batch at a time; every example must still be its
    record decoded on its own (RGB to gray; PNGs of mixed sizes resized),
    with its own label, on 1 and 2 replicas and on sharded files."""
    from input.images import fit_images

    rng = np.random.RandomState(3)
    for index, side in enumerate(sides):
        images = rng.randint(0, 256, (24, side, side, 3), dtype=np.uint8)
        write_tfrecords(str(tmp_path / f"train-{index}"), images, rng.randint(0, 10, 24))
    shape = (8, 8, 1)
    expected = {}
    features = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}
    for record in tf.data.TFRecordDataset(sorted(str(path) for path in tmp_path.glob("train-*"))):
        example = tf.io.parse_single_example(record, features)
        image = tf.image.convert_image_dtype(tf.io.decode_png(example["image"], channels=1), tf.float32)
        expected[fit_images(image, shape).numpy().tobytes()] = int(example["label"])
    assert len(expected) == 72
    source = get_data_source("tfrecord", image_shape=shape, data_dir=str(tmp_path))

    for input_context, count in [(None, 9), (context(1, 0, 2), 18), (context(2, 1, 2), 6)]:
        seen = {}
        for images, labels in take(
            source.train_dataset(global_batch_size=8, seed=5, input_context=input_context), count
        ):
            assert images.dtype == np.float32 and images.shape[1:] == shape
            seen.update((image.tobytes(), int(label)) for image, label in zip(images, labels, strict=True))
        assert seen.items() <= expected.items()  # each image with its own label
        if input_context is None or input_context.num_input_pipelines == 1:
            assert len(seen) == 72  # one epoch: every record once


def test_tfrecord_glob_without_match_is_a_data_error(tmp_path) -> None:
    pattern = str(tmp_path / "nothing-*.tfrecord")
    with pytest.raises(DataError) as error:
        get_data_source("tfrecord", image_shape=(8, 8, 1), data_dir=pattern)
    assert str(error.value).startswith(f"no TFRecord files match {pattern!r}; ")
    assert "train*" in str(error.value)


def test_tfrecord_corrupt_file_is_named(tmp_path, record_dir) -> None:
    directory, images, labels = record_dir
    write_tfrecords(str(tmp_path / "train-good"), images[:4], labels[:4])
    corrupt = tmp_path / "train-junk"
    corrupt.write_bytes(np.random.RandomState(1).bytes(200))
    with pytest.raises(DataError) as error:
        get_data_source("tfrecord", image_shape=(8, 8, 1), data_dir=str(tmp_path))
    assert str(error.value).startswith(f"cannot read TFRecord file {corrupt}:")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("cut", [1, 14, 200, -9], ids=["data_crc", "into_data", "records", "partial_header"])
def test_a_truncated_tfrecord_file_is_named_up_front(tmp_path, record_dir, cut) -> None:
    """A file cut short reads fine up to its last record: only the framing shows it."""
    directory, images, labels = record_dir
    write_tfrecords(str(tmp_path / "train-0"), images[:40], labels[:40])
    cut_file = tmp_path / "train-1"
    write_tfrecords(str(cut_file), images[40:80], labels[40:80])
    data = cut_file.read_bytes()
    # A negative cut leaves the file ending inside the 12-byte header of one more record.
    cut_file.write_bytes(data[: len(data) - cut] if cut > 0 else data + b"\x00" * -cut)
    with pytest.raises(DataError) as error:
        get_data_source("tfrecord", image_shape=(8, 8, 1), data_dir=str(tmp_path))
    message = str(error.value)
    assert message.startswith(f"TFRecord file {cut_file} is truncated: its record at byte "), message
    assert "copy the file again or remove it from --data_dir" in message and "\n" not in message


def test_tfrecord_glob_pattern_selects_train_files_only(record_dir) -> None:
    directory, _, _ = record_dir
    source = get_data_source("tfrecord", image_shape=(8, 8, 1), data_dir=os.path.join(directory, "train-1*"))
    assert source.eval_dataset(global_batch_size=8) is None
    assert source.num_eval_examples is None


# --- registry -------------------------------------------------------------------------


def test_unknown_dataset_lists_choices() -> None:
    assert dataset_names() == ["digits", "mnist", "synthetic", "tfrecord", "clicks"]
    with pytest.raises(DataError) as error:
        get_data_source("cifar10", image_shape=(32, 32, 3))
    assert str(error.value) == (
        "unknown dataset 'cifar10'; choose one of: digits, mnist, synthetic, tfrecord, clicks, or PATH.npz, "
        "PATH.csv, PATH.parquet, tfds:NAME[/CONFIG], package.module:function"
    )


def test_synthetic_has_any_shape_and_class_count() -> None:
    source = get_data_source("synthetic", image_shape=(5, 7, 3), num_classes=3)
    images, labels = take(source.train_dataset(global_batch_size=1024, seed=0), 1)[0]
    assert images.shape == (1024, 5, 7, 3)
    assert set(labels) == {0, 1, 2}
    assert source.num_eval_examples == 256

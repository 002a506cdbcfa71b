"""--dataset=tfds:NAME[/CONFIG]: tensorflow-datasets sets read offline from --data_dir.

The sets are prepared here, in a temporary data_dir, by tiny GeneratorBasedBuilders whose
examples are in memory (no download; tensorflow-datasets' GCS access is off by default).
They are not registered (`skip_registration=True`), so the engine reads them from their
files alone, as it reads a set prepared on another machine whose builder code is not
installed here."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, main_in_process, one_error_line, python_env, snapshot

from input import DataError, get_data_source

tfds = pytest.importorskip("tensorflow_datasets")

IMAGE_SHAPE = (8, 8, 1)
NUM_TRAIN, NUM_TEST = 40, 12
CLASSES = 5  # The ClassLabel's count; the examples hold only labels 0..3.


def _images(count: int, seed: int):
    rng = np.random.RandomState(seed)
    for i in range(count):
        yield i, {"image": rng.randint(0, 256, IMAGE_SHAPE).astype(np.uint8), "label": i % (CLASSES - 1)}


class EngineTfdsImages(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """8x8 gray images, a train and a test split, 5 classes."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=IMAGE_SHAPE),
                    "label": tfds.features.ClassLabel(num_classes=CLASSES),
                }
            ),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(NUM_TRAIN, 0), "test": self._generate_examples(NUM_TEST, 1)}

    def _generate_examples(self, count, seed):
        yield from _images(count, seed)


class EngineTfdsTable(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Rows of float32 values and a class, a train split only, in two configs (row widths)."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="narrow"), tfds.core.BuilderConfig(name="wide")]

    def _info(self):
        width = 2 if self.builder_config.name == "narrow" else 6
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {"row": tfds.features.Tensor(shape=(width,), dtype=np.float32), "label": np.int64}
            ),
            supervised_keys=("row", "label"),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        width = 2 if self.builder_config.name == "narrow" else 6
        rng = np.random.RandomState(2)
        for i in range(30):
            yield i, {"row": rng.normal(size=width).astype(np.float32), "label": i % 3}


class EngineTfdsUnsupervised(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Images without supervised keys."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {"image": tfds.features.Image(shape=IMAGE_SHAPE), "label": np.int64}
            ),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        yield from _images(3, 0)


class EngineTfdsRagged(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Images of two sizes."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(None, None, 1)),
                    "label": tfds.features.ClassLabel(num_classes=2),
                }
            ),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for i, size in enumerate((4, 6, 4)):
            yield i, {"image": np.zeros((size, size, 1), np.uint8), "label": i % 2}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    """A data_dir holding every set above, prepared offline."""
    directory = str(tmp_path_factory.mktemp("tensorflow_datasets"))
    tfds.disable_progress_bar()
    offline = tfds.download.DownloadConfig(try_download_gcs=False)
    builders = [
        EngineTfdsImages(data_dir=directory),
        EngineTfdsTable(data_dir=directory, config="wide"),
        EngineTfdsUnsupervised(data_dir=directory),
        EngineTfdsRagged(data_dir=directory),
    ]
    for builder in builders:
        builder.download_and_prepare(download_config=offline)
    return directory


def _tfds_arrays(data_dir: str, name: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """What tensorflow-datasets itself gives for the split, in its files' order."""
    dataset = tfds.builder(name, data_dir=data_dir).as_dataset(
        split=split, as_supervised=True, shuffle_files=False
    )
    examples = list(tfds.as_numpy(dataset))
    return np.stack([x for x, _ in examples]), np.array([y for _, y in examples])


def _held_arrays(source) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The (train, eval) arrays an in-memory source holds, as stored (uint8 images unscaled)."""
    return (
        (source._train_images.numpy(), source._train_labels.numpy()),
        (source._eval_images.numpy(), source._eval_labels.numpy()),
    )


def _error(name: str, data_dir: str | None, **options) -> str:
    with pytest.raises(DataError) as error:
        get_data_source(name, data_dir=data_dir, **options)
    message = str(error.value)
    assert "\n" not in message, message
    return message


# --- reading ------------------------------------------------------------------------


def test_a_prepared_set_is_read_from_its_files_with_its_splits_and_classes(data_dir) -> None:
    source = get_data_source("tfds:engine_tfds_images", data_dir=data_dir)
    assert source.name == "tfds:engine_tfds_images"
    assert (source.num_train_examples, source.num_eval_examples) == (NUM_TRAIN, NUM_TEST)
    assert source.feature_shape == IMAGE_SHAPE
    # The ClassLabel's 5 classes, though no example has label 4.
    assert (source.labels.kind, source.num_classes) == ("classes", CLASSES)
    (x_train, y_train), (x_eval, y_eval) = _held_arrays(source)
    assert x_train.dtype == np.uint8 and y_train.dtype == np.int32  # uint8: scaled by 1/255 when batched
    for (x, y), split in (((x_train, y_train), "train"), ((x_eval, y_eval), "test")):
        expected_x, expected_y = _tfds_arrays(data_dir, "engine_tfds_images", split)
        np.testing.assert_array_equal(x, expected_x)
        np.testing.assert_array_equal(y, expected_y)
    ((images, labels),) = list(source.eval_dataset(global_batch_size=NUM_TEST).take(1))
    np.testing.assert_allclose(images.numpy(), x_eval.astype(np.float32) / 255.0)
    np.testing.assert_array_equal(labels.numpy(), y_eval)


def test_a_version_in_the_name_reads_that_version(data_dir) -> None:
    source = get_data_source("tfds:engine_tfds_images:1.0.0", data_dir=data_dir)
    assert (source.num_train_examples, source.num_eval_examples) == (NUM_TRAIN, NUM_TEST)
    message = _error("tfds:engine_tfds_images:9.9.9", data_dir)
    assert message.startswith(
        f"--dataset=tfds:engine_tfds_images:9.9.9 is not prepared in {data_dir}, which holds only "
        "tfds:engine_tfds_images:1.0.0; name one of those"
    )


def test_without_data_dir_the_set_is_read_from_tensorflow_datasets_default_dir(data_dir, monkeypatch) -> None:
    # $TFDS_DATA_DIR (else ~/tensorflow_datasets), which tfds reads once, at its import.
    monkeypatch.setattr(tfds.core.constants, "DATA_DIR", data_dir)
    source = get_data_source("tfds:engine_tfds_images", data_dir=None)
    assert (source.num_train_examples, source.num_eval_examples) == (NUM_TRAIN, NUM_TEST)
    assert _error("tfds:mnist", None).startswith(f"--dataset=tfds:mnist is not prepared in {data_dir} ")


def test_without_test_or_validation_split_eval_fraction_is_held_out_of_train(data_dir) -> None:
    name = "tfds:engine_tfds_table/wide"
    source = get_data_source(name, data_dir=data_dir, eval_fraction=0.2)
    assert (source.num_train_examples, source.num_eval_examples) == (24, 6)
    assert source.feature_shape == (6,)
    assert (source.labels.kind, source.num_classes) == ("classes", 3)  # int64 labels: the largest + 1
    (x_train, y_train), (x_eval, y_eval) = _held_arrays(source)
    assert x_train.dtype == np.float32
    x, y = _tfds_arrays(data_dir, "engine_tfds_table/wide", "train")
    # Train and eval are the set's 30 examples, each once.
    together = np.concatenate([x_train, x_eval])
    order = [int(np.flatnonzero((x == row).all(axis=1))[0]) for row in together]
    assert sorted(order) == list(range(30))
    np.testing.assert_array_equal(np.concatenate([y_train, y_eval]), y[order])
    # The same held-out examples on every load, whatever the run's seed.
    again = get_data_source(name, data_dir=data_dir, eval_fraction=0.2)
    np.testing.assert_array_equal(_held_arrays(again)[1][0], x_eval)
    no_eval = get_data_source(name, data_dir=data_dir, eval_fraction=0.0)
    assert (no_eval.num_train_examples, no_eval.num_eval_examples) == (30, None)


def test_num_classes_and_label_kind_are_the_runs_when_given(data_dir) -> None:
    source = get_data_source("tfds:engine_tfds_images", data_dir=data_dir, num_classes=7)
    assert source.num_classes == 7
    values = get_data_source("tfds:engine_tfds_images", data_dir=data_dir, label_kind="values")
    assert values.labels.kind == "values"
    assert _held_arrays(values)[0][1].dtype == np.float32


# --- refusals: one line each ---------------------------------------------------------


def test_a_set_not_prepared_says_how_to_prepare_it(tmp_path) -> None:
    empty = str(tmp_path / "empty")
    message = _error("tfds:mnist", empty)  # tensorflow-datasets' own MNIST builder: code, no files
    assert message.startswith(f"--dataset=tfds:mnist is not prepared in {empty} (no {empty}/mnist/")
    assert f"`tfds build mnist --data_dir={empty}`" in message
    assert f"tfds.builder('mnist', data_dir='{empty}').download_and_prepare()" in message
    assert message.endswith(f"and copy {empty} here")
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").rglob("*.tfrecord*"))


@pytest.mark.parametrize("name", ["engine_tfds_table/narrow", "engine_tfds_table"])
def test_a_config_not_prepared_names_the_prepared_ones(data_dir, name) -> None:
    message = _error(f"tfds:{name}", data_dir)  # Only "wide" was prepared; no code tells the default.
    assert message.startswith(
        f"--dataset=tfds:{name} is not prepared in {data_dir}, which holds only "
        "tfds:engine_tfds_table/wide:1.0.0; name one of those"
    )


def test_an_unknown_config_or_version_of_an_installed_builder_is_one_line(tmp_path) -> None:
    message = _error("tfds:mnist/no_such_config", str(tmp_path))
    assert (
        message
        == "--dataset=tfds:mnist/no_such_config: BuilderConfig no_such_config not found with version 3.0.1"
    )
    message = _error("tfds:cifar10_corrupted/no_such_config", str(tmp_path))
    assert "; its configs: brightness_1, brightness_2," in message
    message = _error("tfds:mnist:9.9.9", str(tmp_path))
    assert message == "--dataset=tfds:mnist:9.9.9: Dataset mnist cannot be loaded at version 9.9.9, only: 3.0.1"


def test_a_name_tensorflow_datasets_cannot_parse_is_one_line(tmp_path) -> None:
    message = _error("tfds:a:b:c", str(tmp_path))
    assert message.startswith("--dataset=tfds:a:b:c is not a tensorflow-datasets name; write NAME, NAME/CONFIG")


def test_an_unknown_name_says_where_names_are(data_dir) -> None:
    message = _error("tfds:no_such_set_anywhere", data_dir)
    assert message.startswith(
        f"--dataset=tfds:no_such_set_anywhere: tensorflow-datasets has no data set 'no_such_set_anywhere' and "
        f"no prepared files of it are in {data_dir}; see https://www.tensorflow.org/datasets/catalog/overview"
    )
    assert "tfds.list_builders()" in message


def test_names_tensorflow_datasets_fetches_over_the_network_are_refused(tmp_path) -> None:
    message = _error("tfds:huggingface:mnist", str(tmp_path))
    assert "'huggingface' namespace" in message and "fetches over the network" in message


def test_a_set_without_supervised_keys_is_refused(data_dir) -> None:
    message = _error("tfds:engine_tfds_unsupervised", data_dir)
    assert message.startswith("--dataset=tfds:engine_tfds_unsupervised has no supervised keys")
    assert "['image', 'label']" in message and "package.module:function" in message


def test_images_of_varying_sizes_are_refused(data_dir) -> None:
    message = _error("tfds:engine_tfds_ragged", data_dir)
    assert message.startswith("--dataset=tfds:engine_tfds_ragged split 'train': its features vary in shape")
    assert "package.module:function" in message and "--dataset=tfrecord" in message


def test_a_split_larger_than_memory_allows_is_refused_before_reading(data_dir, monkeypatch) -> None:
    import input.tfds_data

    monkeypatch.setattr(input.tfds_data, "MAX_IN_MEMORY_BYTES", 1000)
    message = _error("tfds:engine_tfds_images", data_dir)
    assert message.startswith(f"--dataset=tfds:engine_tfds_images split 'train' holds {NUM_TRAIN} examples of")
    assert "input.DataSource" in message


def _with_info(info: dict, **changes) -> str:
    return json.dumps({**info, **changes})


def _supervised_by(key: str) -> dict:
    return {"tuple": {"items": [{"featureKey": key}, {"featureKey": "label"}]}}


# (the file, its new text from the prepared one's JSON, what the one line says)
DAMAGE = {
    "garbage": ("dataset_info.json", lambda info: "garbage{{{", "dataset_info.json is damaged (JSONDecodeError"),
    "truncated": ("dataset_info.json", lambda info: json.dumps(info)[:200], "dataset_info.json is damaged ("),
    "empty": ("dataset_info.json", lambda info: "", "dataset_info.json is damaged (JSONDecodeError"),
    "a list": ("dataset_info.json", lambda info: "[]", "dataset_info.json is damaged (not a JSON object"),
    "no version": (
        "dataset_info.json",
        lambda info: json.dumps({k: v for k, v in info.items() if k != "version"}),
        "dataset_info.json is damaged (no name or no x.y.z version)",
    ),
    "splits": ("dataset_info.json", lambda info: _with_info(info, splits="x"), "its splits are not a list"),
    "shard lengths": (
        "dataset_info.json",
        lambda info: _with_info(info, splits=[{**info["splits"][0], "shardLengths": ["abc"]}]),
        "tensorflow-datasets cannot read the files prepared in",
    ),
    "negative count": (
        "dataset_info.json",
        lambda info: _with_info(info, splits=[{**info["splits"][0], "shardLengths": ["-5"]}]),
        "dataset_info.json describes it (ValueError",
    ),
    "a missing label feature": (
        "dataset_info.json",
        lambda info: _with_info(info, supervisedKeys=_supervised_by("nope")),
        "dataset_info.json describes it (KeyError: 'nope')",
    ),
    "features": ("features.json", lambda info: "garbage", "features.json is damaged (JSONDecodeError"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_dataset_info_or_features_file_is_one_line_naming_it(data_dir, tmp_path, damage) -> None:
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    version = copy / "engine_tfds_images" / "1.0.0"
    file, text, said = DAMAGE[damage]
    info = json.loads((version / "dataset_info.json").read_text())
    (version / file).write_text(text(info))
    message = _error("tfds:engine_tfds_images", str(copy))
    assert message.startswith("--dataset=tfds:engine_tfds_images"), message
    assert said in message and "prepare the set again" in message, message
    if "cannot read the files" not in said:
        assert str(version / file) in message, message


def test_without_tensorflow_datasets_installed_it_says_how_to_install_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # `import` raises ImportError
    message = _error("tfds:mnist", str(tmp_path))
    assert message.endswith("pip install tensorflow-datasets")


# --- the command line ----------------------------------------------------------------


@pytest.mark.cli
@pytest.mark.slow  # trains (a few seconds)
def test_the_command_line_trains_and_evaluates_on_a_prepared_set(data_dir, tmp_path) -> None:
    model_dir = tmp_path / "run"
    result = main_in_process(
        "--dataset=tfds:engine_tfds_images",
        f"--data_dir={data_dir}",
        "--model=mlp",
        "--train_steps=4",
        "--global_batch_size=8",
        "--eval_every=0",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["global_step"] == 4
    assert metrics["eval"]["num_examples"] == NUM_TEST


@pytest.mark.cli
def test_the_command_line_refuses_an_unprepared_set_in_one_line_writing_nothing(tmp_path) -> None:
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "notes.txt").write_text("an earlier run's files")
    before = snapshot(model_dir)
    empty = tmp_path / "empty"
    result = main_in_process(
        "--dataset=tfds:mnist",
        f"--data_dir={empty}",
        "--model=mlp",
        "--train_steps=4",
        f"--model_dir={model_dir}",
    )
    line = one_error_line(result)
    assert f"--dataset=tfds:mnist is not prepared in {empty}" in line
    assert snapshot(model_dir) == before


@pytest.mark.cli
def test_the_command_line_refuses_a_damaged_dataset_info_in_one_line_writing_nothing(data_dir, tmp_path) -> None:
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    (copy / "engine_tfds_images" / "1.0.0" / "dataset_info.json").write_text("{")
    result = main_in_process(
        "--dataset=tfds:engine_tfds_images",
        f"--data_dir={copy}",
        "--model=mlp",
        "--train_steps=4",
        f"--model_dir={tmp_path / 'run'}",
    )
    line = one_error_line(result)
    assert "dataset_info.json is damaged" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.process  # a fresh interpreter: this one has imported tensorflow_datasets
@pytest.mark.timeout(120)
def test_other_data_sets_and_the_module_itself_do_not_import_tensorflow_datasets() -> None:
    code = (
        "import sys, input.tfds_data; from input import get_data_source; "
        "get_data_source('digits', image_shape=(28, 28, 1)); "
        "print('tensorflow_datasets' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=100
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"

"""`--dataset=tfds:NAME[/CONFIG][:VERSION]`: a tensorflow-datasets set, read offline.

The set must already be prepared (by `tfds build` or `download_and_prepare` on a
machine with internet) in --data_dir, or in tensorflow-datasets' default data dir
($TFDS_DATA_DIR, else ~/tensorflow_datasets). Nothing is ever downloaded: the
engine's machines may have no network, and a download in the middle of a
distributed start-up would hang every worker. A set whose builder code is not
installed is read from its files alone (`tfds.builder` falls back to a read-only
builder from the prepared `dataset_info.json` and `features.json`).

The `train` split trains; `test`, else `validation`, evaluates, else
--eval_fraction of train is held out. The (features, label) pairs are the
builder's supervised keys, read into memory whole (`input.arrays`), so that the
engine shuffles, shards and resumes them exactly.
"""

from __future__ import annotations

import json
import math
import os
import re
from types import ModuleType
from typing import Any

import numpy as np

from input.arrays import source_from_arrays, split_off_eval
from input.errors import DataError
from input.in_memory import InMemorySource
from input.user_data import MAX_IN_MEMORY_BYTES

TRAIN_SPLIT = "train"
EVAL_SPLITS = ("test", "validation")  # The first one the set has evaluates.
CATALOG = "https://www.tensorflow.org/datasets/catalog/overview"
_READ_BATCH = 4096


def load_tfds(name: str, options: Any) -> InMemorySource:
    """The in-memory source of the prepared set `name` (what follows `tfds:`);
    `options` (input.registry.DataOptions) gives data_dir, eval_fraction, label_kind
    and num_classes."""
    tfds = _import_tfds(name)
    builder = _prepared_builder(tfds, name, options.data_dir)
    where = f"--dataset=tfds:{name}"
    splits = list(builder.info.splits)
    if TRAIN_SPLIT not in splits:
        raise DataError(
            f"{where} has no {TRAIN_SPLIT!r} split (its splits: {splits}); the engine trains on 'train'"
        )
    label_key = _label_key(builder, where)
    train = _read_split(tfds, builder, TRAIN_SPLIT, where)
    eval_name = next((split for split in EVAL_SPLITS if split in splits), None)
    eval_split: tuple[np.ndarray, np.ndarray] | None
    if eval_name is not None:
        eval_split = _read_split(tfds, builder, eval_name, where)
    else:
        train, eval_split = split_off_eval(*train, options.eval_fraction, where)
    num_classes = options.num_classes or _class_count(tfds, builder, label_key)
    return source_from_arrays(
        f"tfds:{name}", train, eval_split, label_kind=options.label_kind, num_classes=num_classes
    )


def _import_tfds(name: str) -> ModuleType:
    """tensorflow_datasets, imported only here: it is optional, and --help and every
    other data set must not pay for its import."""
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise DataError(
            f"--dataset=tfds:{name} needs tensorflow-datasets, which is not installed: "
            "pip install tensorflow-datasets"
        ) from None
    return tfds


def _prepared_builder(tfds: ModuleType, name: str, data_dir: str | None) -> Any:
    """The builder of `name` in `data_dir` (None: tfds's default), refused unless its
    files are prepared there. Never downloads: no download_and_prepare here."""
    where = f"--dataset=tfds:{name}"
    try:
        parsed, _ = tfds.core.naming.parse_builder_name_kwargs(name)
    except ValueError:
        raise DataError(
            f"{where} is not a tensorflow-datasets name; write NAME, NAME/CONFIG or NAME/CONFIG:VERSION "
            f"(e.g. tfds:mnist, tfds:mnist:3.0.1)"
        ) from None
    if parsed.namespace:  # kaggle:, huggingface:, community sets are fetched over the network.
        raise DataError(
            f"{where} names a set of the {parsed.namespace!r} namespace, which tensorflow-datasets fetches "
            "over the network; the engine reads only sets prepared in --data_dir"
        )
    shown_dir = data_dir or tfds.core.constants.DATA_DIR
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError:  # No builder code, and no files of this variant.
        variants = _prepared_variants(shown_dir, parsed.name)
        if variants:
            raise DataError(
                f"{where} is not prepared in {shown_dir}, which holds only {', '.join(variants)}; "
                "name one of those (its builder code is not installed here to tell more)"
            ) from None
        raise DataError(
            f"{where}: tensorflow-datasets has no data set {parsed.name!r} and no prepared files of it are in "
            f'{shown_dir}; see {CATALOG} or python -c "import tensorflow_datasets as tfds; '
            'print(tfds.list_builders())" for the names'
        ) from None
    except Exception as error:  # noqa: BLE001 - what a damaged file of the set makes tfds raise varies
        damaged = _damaged_files(shown_dir, parsed.name)
        if damaged:
            raise DataError(_damaged_message(where, damaged)) from None
        text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        variant = "BuilderConfig" in text or "version" in text  # A config or version it does not know.
        # Files that parse, yet tensorflow-datasets cannot use:
        if not (variant and isinstance(error, (ValueError, AssertionError))) and _prepared_variants(
            shown_dir, parsed.name
        ):
            files = os.path.join(shown_dir, parsed.name)
            raise DataError(
                f"{where}: tensorflow-datasets cannot read the files prepared in {files} "
                f"({type(error).__name__}: {text}); their dataset_info.json or features.json is damaged: "
                "prepare the set again (tfds build) or copy it again from the machine that prepared it"
            ) from None
        if not isinstance(error, (ValueError, AssertionError)):
            raise
        # An unknown config or version of a known set:
        # 'Failed to construct dataset "mnist", builder_kwargs "{...}": BuilderConfig x not found ...'
        message = str(error).strip().splitlines()[0].split('}": ', 1)[-1].split(" Here are ")[0].rstrip(". ")
        raise DataError(f"{where}: {message}{_configs_hint(tfds, parsed.name)}") from None
    if not builder.is_prepared():
        root = str(builder.data_dir_root)
        raise DataError(
            f"{where} is not prepared in {root} (no {builder.data_path}); on a machine with internet run "
            f'`tfds build {name} --data_dir={root}` (or python -c "import tensorflow_datasets as tfds; '
            f"tfds.builder('{name}', data_dir='{root}').download_and_prepare()\") and copy {root} here"
        )
    return builder


_VERSION = re.compile(r"^\d+\.\d+\.\d+$")


def _damaged_files(data_dir: str, name: str) -> list[tuple[str, str]]:
    """(path, what is wrong) for each dataset_info.json or features.json of `name`'s prepared
    variants in `data_dir` that is not what tensorflow-datasets writes: not JSON, not an
    object, or a DatasetInfo without its name, version or a list of splits."""
    damaged = []
    for directory, subdirectories, files in os.walk(os.path.join(data_dir, name)):
        subdirectories[:] = [d for d in subdirectories if not d.startswith("incomplete.")]
        for file in ("dataset_info.json", "features.json"):
            if file in files:
                path = os.path.join(directory, file)
                problem = _json_problem(path, info=file == "dataset_info.json")
                if problem is not None:
                    damaged.append((path, problem))
    return damaged


def _json_problem(path: str, *, info: bool) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors.
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    if not isinstance(value, dict) or not value:
        return f"not a JSON object of its fields but {type(value).__name__} {str(value)[:40]}"
    if info:
        if not isinstance(value.get("name"), str) or not _VERSION.match(str(value.get("version", ""))):
            return "no name or no x.y.z version"
        splits = value.get("splits", [])
        if not isinstance(splits, list) or not all(isinstance(split, dict) for split in splits):
            return "its splits are not a list of objects"
    return None


def _damaged_message(where: str, damaged: list[tuple[str, str]]) -> str:
    path, problem = damaged[0]
    more = f" (and {len(damaged) - 1} more such file(s))" if len(damaged) > 1 else ""
    return (
        f"{where}: {path} is damaged ({problem}){more}; prepare the set again (tfds build) or copy it again "
        "from the machine that prepared it"
    )


def _prepared_variants(data_dir: str, name: str) -> list[str]:
    """The --dataset values of the variants of `name` prepared in `data_dir`: a directory
    DATA_DIR/NAME[/CONFIG]/VERSION holding a dataset_info.json is one."""
    dataset_dir = os.path.join(data_dir, name)
    if not os.path.isdir(dataset_dir):
        return []
    variants = []
    for directory, subdirectories, files in os.walk(dataset_dir):
        # tfds writes into incomplete.XXXXXX_VERSION and renames it when done: not prepared.
        subdirectories[:] = [d for d in subdirectories if not d.startswith("incomplete.")]
        if "dataset_info.json" in files:
            *config, version = os.path.relpath(directory, dataset_dir).split(os.sep)
            variants.append(f"tfds:{'/'.join([name, *config])}:{version}")
    return sorted(variants)


def _configs_hint(tfds: ModuleType, name: str) -> str:
    """'; its configs: a, b' when the builder code of `name` is installed and has configs."""
    try:
        configs = list(tfds.builder_cls(name).builder_configs)
    except Exception:  # No code, or a name tfds cannot parse: nothing to add.
        return ""
    return f"; its configs: {', '.join(configs[:20])}{', ...' if len(configs) > 20 else ''}" if configs else ""


def _label_key(builder: Any, where: str) -> str | None:
    """The feature the supervised pairs take their labels from (None when nested)."""
    keys = builder.info.supervised_keys
    if keys is None:
        features = sorted(builder.info.features.keys()) if hasattr(builder.info.features, "keys") else []
        raise DataError(
            f"{where} has no supervised keys (a (features, label) pair) in its DatasetInfo; its features are "
            f"{features}; pass --dataset=package.module:function that maps its examples to (features, labels)"
        )
    return keys[1] if len(keys) >= 2 and isinstance(keys[1], str) else None


def _class_count(tfds: ModuleType, builder: Any, label_key: str | None) -> int | None:
    """The ClassLabel's num_classes: the test split may hold no example of the last class."""
    if label_key is None:
        return None
    feature = builder.info.features[label_key]
    if isinstance(feature, tfds.features.ClassLabel) and feature.num_classes:
        return int(feature.num_classes)
    return None


def _read_split(tfds: ModuleType, builder: Any, split: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(features, labels) of every example of `split`, in the files' order, into arrays
    allocated once (the split's size is in its DatasetInfo); refused before reading when
    the examples vary in shape, are not numbers or would not fit MAX_IN_MEMORY_BYTES."""
    import tensorflow as tf

    where = f"{where} split {split!r}"
    try:
        dataset = builder.as_dataset(split=split, as_supervised=True, shuffle_files=False)
    except (ValueError, KeyError, TypeError, AssertionError) as error:  # What its DatasetInfo says is wrong.
        detail = str(error).splitlines()[0][:160] if str(error) else ""
        info = os.path.join(builder.data_dir, "dataset_info.json")
        raise DataError(
            f"{where}: tensorflow-datasets cannot read it as {info} describes it ({type(error).__name__}: "
            f"{detail}); that file is damaged: prepare the set again (tfds build) or copy it again from the "
            "machine that prepared it"
        ) from None
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2 and all(isinstance(s, tf.TensorSpec) for s in spec)):
        raise DataError(
            f"{where}: its supervised pairs are {spec}, not (one tensor of features, one of labels); pass "
            "--dataset=package.module:function that maps its examples to (features, labels)"
        )
    for part, tensor in zip(("features", "labels"), spec, strict=True):
        if not tensor.shape.is_fully_defined():
            raise DataError(
                f"{where}: its {part} vary in shape ({tensor.shape}); pass --dataset=package.module:function "
                "that resizes them (from tfds.load), or write them at one size as --dataset=tfrecord files"
            )
        if not (tensor.dtype.is_integer or tensor.dtype.is_floating or tensor.dtype == tf.bool):
            raise DataError(
                f"{where}: its {part} are {tensor.dtype.name}, not numbers; pass "
                "--dataset=package.module:function that encodes them as numbers"
            )
    count = int(builder.info.splits[split].num_examples)
    if count < 1:
        raise DataError(f"{where} holds no examples")
    example_bytes = sum(math.prod(s.shape) * s.dtype.size for s in spec)
    if count * example_bytes > MAX_IN_MEMORY_BYTES:
        raise DataError(
            f"{where} holds {count} examples of {count * example_bytes / 2**30:.1f} GiB, more than the "
            f"{MAX_IN_MEMORY_BYTES / 2**30:.0f} GiB read into memory; pass --dataset=package.module:function "
            "returning an input.DataSource that streams it, or write it as --dataset=tfrecord files"
        )
    features = np.empty((count, *spec[0].shape), dtype=spec[0].dtype.as_numpy_dtype)
    labels = np.empty((count, *spec[1].shape), dtype=spec[1].dtype.as_numpy_dtype)
    filled, too_many = 0, False
    try:
        for batch_features, batch_labels in tfds.as_numpy(dataset.batch(_READ_BATCH)):
            end = filled + len(batch_features)
            if end > count:
                too_many = True
                break
            features[filled:end], labels[filled:end] = batch_features, batch_labels
            filled = end
    except tf.errors.OpError as error:
        raise DataError(
            f"{where}: reading its files in {builder.data_dir} failed: {str(error).splitlines()[0][:200]}; "
            "prepare it again"
        ) from None
    if too_many or filled != count:
        raise DataError(
            f"{where} holds {'more' if too_many else 'fewer'} examples than the {count} its "
            "dataset_info.json says; prepare it again"
        )
    return features, labels

"""Input pipelines: resumable tf.data training streams and eval splits.

The training stream is a pure function of (seed, global step), so a restarted
run sees exactly the batches an uninterrupted run would have seen.
"""

from input import table_layers, tables
from input.errors import DataError
from input.labels import LabelSpec
from input.registry import FORMS as DATASET_FORMS
from input.registry import DataOptions, check_dataset_name, dataset_names, get_data_source
from input.source import DataSource, DescribedSource
from input.tfrecord import write_tfrecords
from input.user_data import as_data_source

__all__ = [
    "DATASET_FORMS",
    "DataError",
    "DataOptions",
    "DataSource",
    "DescribedSource",
    "LabelSpec",
    "as_data_source",
    "check_dataset_name",
    "dataset_names",
    "get_data_source",
    "table_layers",
    "tables",
    "write_tfrecords",
]

"""Input pipelines: resumable tf.data training streams and eval splits.

The training stream is a pure function of (seed, global step), so a restarted
run sees exactly the batches an uninterrupted run would have seen.
"""

from input.errors import DataError
from input.registry import dataset_names, get_data_source
from input.source import DataSource
from input.tfrecord import write_tfrecords

__all__ = [
    "DataError",
    "DataSource",
    "dataset_names",
    "get_data_source",
    "write_tfrecords",
]

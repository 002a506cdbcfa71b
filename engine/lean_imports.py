"""TensorFlow imported for the command line without the optional libraries Keras pulls in.

Importing Keras 3 imports scikit-learn (for `keras.wrappers`), IPython (a notebook
file editor in `keras.saving`), matplotlib.pyplot (`keras.visualization`) and pandas
(its array adapters, which `fit` uses and the engine does not: it converts pandas
itself), and TensorFlow's own legacy Keras imports scipy.sparse, whenever they are
installed: a third of the CPU that TensorFlow and Keras take to import, in every
`engine.main`, `engine.server` and task of a cluster (benchmarks/RESULTS.md,
"Figures behind the code's choices"). Likewise
TensorBoard's hparams summaries import its stand-in for TensorFlow, which
registers S3 and fsspec file systems through boto3 and fsspec where installed,
for writers that never use it while TensorFlow is there.
The command line uses none of those features, so its first import of TensorFlow
and of the run's modules happens with these hidden (Keras and TensorBoard then
define those features without them). They stay importable afterwards: a
benchmark loads matplotlib, `--dataset=PATH.csv` pandas, `--dataset=tfds:NAME` what
tensorflow-datasets needs. The library (`import engine`) never hides anything: research code keeps
every Keras feature.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from collections.abc import Iterator

HIDDEN_WHILE_KERAS_STARTS = ("sklearn", "IPython", "matplotlib", "pandas", "scipy")
HIDDEN_WHILE_TENSORBOARD_STARTS = ("boto3", "botocore", "fsspec")
HIDDEN = HIDDEN_WHILE_KERAS_STARTS + HIDDEN_WHILE_TENSORBOARD_STARTS


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden at start-up)", name=fullname)
        return None


@contextlib.contextmanager
def optional_libraries_hidden() -> Iterator[None]:
    """Within: importing one of `HIDDEN` fails as if absent (unless imported already)."""
    finder = _Hide()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def import_tensorflow_lean() -> None:
    """A command's first import of TensorFlow and Keras (`engine.server`, the data service, a
    benchmark script): the optional libraries hidden meanwhile, TensorFlow's C++ start-up lines
    held back (`engine.native_logs`). Nothing where TensorFlow is imported already, so that code
    that imported it itself (research code, the tests) keeps every Keras feature. (`engine.main`
    also imports its job's modules in the window: `engine.cli.main_command`.)"""
    if "tensorflow" in sys.modules:
        return
    from engine.native_logs import import_tensorflow_quietly

    with optional_libraries_hidden():
        import_tensorflow_quietly()
        import keras  # noqa: F401

"""TensorFlow imported for the command line without the optional libraries Keras pulls in.

Importing Keras 3 imports scikit-learn (for `keras.wrappers`), IPython (a notebook
file editor in `keras.saving`) and matplotlib.pyplot (`keras.visualization`)
whenever they are installed: about 1 s of CPU of the 4 s that TensorFlow and
Keras take to import, in every `engine.main`, `engine.server` and task of a
cluster. The command line uses none of those Keras features, so its first import
of TensorFlow runs with the three hidden (Keras then defines those features
without them). They stay importable afterwards: the digits data set loads
scikit-learn's, a benchmark matplotlib. The library (`import engine`) never
hides anything: research code keeps every Keras feature.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from collections.abc import Iterator

HIDDEN_WHILE_KERAS_STARTS = ("sklearn", "IPython", "matplotlib")


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in HIDDEN_WHILE_KERAS_STARTS:
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden while Keras starts)", name=fullname)
        return None


@contextlib.contextmanager
def optional_libraries_hidden() -> Iterator[None]:
    """Within: importing scikit-learn, IPython or matplotlib fails as if absent (unless imported already)."""
    finder = _Hide()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)

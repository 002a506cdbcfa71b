"""The first lines of a test's own TensorFlow program (`helpers.COMMAND_START`): a parameter-server
coordinator, a resume, a stranger at a rendezvous. It starts as the engine's commands start.

`import engine` would import TensorFlow as the library does for research code: with every
optional library Keras reaches for (scikit-learn, pandas, scipy, IPython, matplotlib), about
2 CPU-s more, and with the interpreter's last full collection over all of it at the exit, about
0.7 more (benchmarks/RESULTS.md: `benchmarks.start_up_imports`). The engine's commands skip
both (engine/command_start.py, engine/lean_imports.py); these programs do the same,
loading those two modules by their paths, since importing them through `engine` would import
TensorFlow first.

Not for the tests' stand-ins of a user's own script (the README's example, research code that
embeds the loop): those start as a user's script does.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def _load(relative_path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"_program_start_{Path(relative_path).stem}", REPO / relative_path
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_load("engine/command_start.py").tune_for_start_up()
with _load("engine/lean_imports.py").optional_libraries_hidden():
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

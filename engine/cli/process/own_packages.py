"""The engine's own top-level `models` and `input` packages, beside a user's
`models.py` or `input.py`.

`models` and `input` are the most common module names in ML projects, and
`python -m engine.main` puts the working directory first on `sys.path`: a
user's `models.py` there would be imported in place of the engine's package
(and break the CLI), or the engine's would replace the user's module inside
the user's own code (`--model=my_net:build` where `my_net` imports its
`models`). The engine therefore reaches these packages only through
`own_package(name)`: normally that is a plain import; when the name resolves
to another file, the engine's package is loaded from its install location
and then taken out of `sys.modules` again, so that both live side by side
and `import models` in the user's code still finds the user's module.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

import engine

OWN_PACKAGES = ("models", "input")
# The directory that holds engine/, models/ and input/ side by side (the repository, or site-packages).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(engine.__file__)))

_private: dict[str, ModuleType] = {}  # Packages loaded beside a user's module of the same name.


def own_package(name: str) -> ModuleType:
    """The engine's package `name` ("models" or "input"), whatever the working directory holds."""
    if name not in OWN_PACKAGES:
        raise ValueError(f"{name!r} is not one of the engine's top-level packages {OWN_PACKAGES}")
    if name in _private:
        return _private[name]
    module = sys.modules.get(name)
    if module is not None and _is_own(module):
        return module
    if module is None:
        spec = importlib.util.find_spec(name)
        if spec is not None and _inside_root(spec.origin):
            return importlib.import_module(name)
    _private[name] = _load_beside(name)
    return _private[name]


def _load_beside(name: str) -> ModuleType:
    """Imports the engine's `name` from ROOT, then gives the name back to whatever held it."""
    held = _pop_tree(name)
    sys.path.insert(0, ROOT)
    try:
        package = importlib.import_module(name)
    finally:
        sys.path.remove(ROOT)
        _pop_tree(name)  # The engine's modules keep working: they imported each other at load time.
        sys.modules.update(held)
    if not _is_own(package):
        raise ImportError(f"the engine's {name!r} package is not in {ROOT}")
    return package


def _pop_tree(name: str) -> dict[str, ModuleType]:
    """Removes and returns `name` and its submodules from sys.modules."""
    return {key: sys.modules.pop(key) for key in list(sys.modules) if key == name or key.startswith(name + ".")}


def _is_own(module: ModuleType) -> bool:
    return _inside_root(getattr(module, "__file__", None))


def _inside_root(path: str | None) -> bool:
    if not path:
        return False
    return os.path.dirname(os.path.dirname(os.path.abspath(path))) == ROOT

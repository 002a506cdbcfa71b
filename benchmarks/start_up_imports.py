r"""What the command line's lean start-up saves: the CPU a fresh process spends importing
TensorFlow and Keras with every optional library they reach for, against the same import
with the engine's hidden list (engine/lean_imports.py), as every `engine.main`,
`engine.server` and data-service process does.

    python -m benchmarks.start_up_imports --repeats=5 --json=benchmarks/out/start_up_imports.json

Each measurement is a fresh interpreter (nothing cached in memory but the operating
system's file cache), the two forms alternating so that a busy machine weighs on both.
Prints one JSON object: each form's median CPU-seconds (user + system) of the import, the
packages each form loaded of the hidden list, and `ratio` (lean over full: below 1 is the
saving).
"""

from __future__ import annotations

import statistics

from absl import app, flags

from benchmarks.fresh_process import measure_in_fresh_process, report

FLAGS = flags.FLAGS

_PROGRAM = """
import importlib.util, json, os, resource, sys
# By its path: `import engine` would import TensorFlow (the library's own start) before the test.
path = os.path.join(os.environ["PYTHONPATH"], "engine", "lean_imports.py")
spec = importlib.util.spec_from_file_location("lean_imports", path)
lean_imports = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lean_imports)
if sys.argv[1] == "lean":
    with lean_imports.optional_libraries_hidden():
        import tensorflow, keras
else:
    import tensorflow, keras
usage = resource.getrusage(resource.RUSAGE_SELF)
loaded = sorted({name.split(".")[0] for name in sys.modules} & set(lean_imports.HIDDEN))
print(json.dumps({"cpu_s": usage.ru_utime + usage.ru_stime, "loaded": loaded}))
"""


def define_flags() -> None:
    """The flags, defined when run as a program."""
    flags.DEFINE_integer("repeats", 5, "Fresh processes per form (the forms alternate).")
    flags.DEFINE_string("json", None, "Also write the JSON line to this path.")


def measure(repeats: int) -> dict:
    """The medians of `repeats` alternating fresh processes of each form."""
    runs: dict[str, list[dict]] = {"full": [], "lean": []}
    for _ in range(repeats):
        for form in runs:
            runs[form].append(measure_in_fresh_process(_PROGRAM, form, timeout=300))
    medians = {form: statistics.median(run["cpu_s"] for run in found) for form, found in runs.items()}
    return {
        "repeats": repeats,
        "full_cpu_s": round(medians["full"], 3),
        "lean_cpu_s": round(medians["lean"], 3),
        "ratio": round(medians["lean"] / medians["full"], 3),
        "full_loaded": runs["full"][-1]["loaded"],
        "lean_loaded": runs["lean"][-1]["loaded"],
    }


def main(argv: list[str]) -> None:
    del argv
    report(measure(FLAGS.repeats), FLAGS.json)


if __name__ == "__main__":
    define_flags()
    app.run(main)

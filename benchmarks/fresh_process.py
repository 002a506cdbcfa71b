"""What the benchmarks that measure whole processes share: a measurement run as a program
of its own (nothing warm, its peak memory its own) that prints one JSON object, and the
result printed and written as one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure_in_fresh_process(program: str, *args: str, timeout: float) -> dict[str, Any]:
    """Runs `program` (Python source) with `args` in a new interpreter that imports from the
    repository; returns the JSON object its last stdout line holds."""
    env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", program, *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process {args} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(result: dict[str, Any], json_path: str | None) -> None:
    """Prints `result` as one JSON line and, with `json_path`, writes that line there too."""
    text = json.dumps(result)
    print(text)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as handle:
            handle.write(text + "\n")

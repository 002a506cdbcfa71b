"""The library stands on its own: `import engine` and its public API never import the command
line (the `engine.cli` and `engine.launch` packages, `engine.main`, `engine.server`) nor define an absl flag."""

import subprocess
import sys

import pytest
from helpers import python_env

PUBLIC_API = """
import sys
import engine
for name in engine.__all__:
    getattr(engine, name)
import engine.trainer.coordinated, engine.callbacks.keras_adapter, engine.cluster.multi_host
import engine.checkpointing.checkpointer, engine.checkpointing.background, engine.checkpointing.discovery
import engine.hooks, engine.export, engine.model_dir, engine.ema, engine.summaries
from absl import flags
commands = ("engine.main", "engine.server")
cli = sorted(m for m in sys.modules if m.startswith(("engine.cli", "engine.launch")) or m in commands)
defined = [f for f in ("model_dir", "strategy", "steps_per_loop") if f in flags.FLAGS]
print("cli modules:", cli, "flags:", defined)
"""


@pytest.mark.process
@pytest.mark.slow  # A fresh interpreter: the test process has imported the CLI already.
def test_the_public_api_imports_no_command_line():
    result = subprocess.run(
        [sys.executable, "-c", PUBLIC_API], env=python_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cli modules: [] flags: []" in result.stdout, result.stdout

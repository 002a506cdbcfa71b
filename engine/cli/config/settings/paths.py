"""The settings' checks that look at the disk: a model_dir or export_dir, predict's files."""

from __future__ import annotations

import os

from engine.errors import UserError


def check_model_dir(model_dir: str, flag: str = "model_dir", writable: bool = True) -> None:
    """A local model_dir (or export_dir) must be a directory, `writable` or creatable as one;
    a remote one (gs://, ram://) is TensorFlow's to check when it is first written."""
    from engine.model_dir import is_remote

    if is_remote(model_dir):
        return
    path = os.path.abspath(model_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"--{flag}={model_dir} is a file; pass a directory")
    if not writable:
        return
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--{flag}={model_dir} is not writable ({existing}); pass a writable directory")


def check_predict_paths(model_dir: str | None, predict_input: str | None, predict_output: str | None) -> None:
    """--mode=predict reads a trained --model_dir and an input file, and writes a new output file."""
    if not model_dir:
        raise UserError("--mode=predict restores the latest checkpoint of a --model_dir; pass one")
    if not predict_input or not predict_output:
        raise UserError("--mode=predict needs --predict_input=PATH (.npz or .csv) and --predict_output=PATH")
    if os.path.splitext(predict_input)[1] not in (".npz", ".csv", ".parquet"):
        raise UserError(
            f"--predict_input={predict_input} must be an .npz (with an x array), a .csv or a .parquet file"
        )
    if not os.path.isfile(predict_input):
        raise UserError(f"--predict_input={predict_input} does not exist or is not a file")
    if os.path.splitext(predict_output)[1] not in (".npy", ".csv"):
        raise UserError(f"--predict_output={predict_output} must end in .npy or .csv")
    if os.path.lexists(predict_output):
        raise UserError(f"--predict_output={predict_output} exists; remove it or pass a new path")
    parent = os.path.dirname(os.path.abspath(predict_output))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--predict_output={predict_output}: {parent} is not a writable directory")

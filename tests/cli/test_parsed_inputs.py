"""Every file engine.main parses before it runs (flagfiles, a user's model module)
fails with one line naming it and what is wrong, exit 2, nothing written. In-process.
TF_CONFIG and Slurm variables: tests/unit/cluster/test_cluster.py.

Covers: engine/cli/config/flagfiles.py.
"""

import textwrap

import pytest
from helpers import main_in_process, one_error_line, snapshot

FLAGFILES = [
    (
        {"bin.flags": b"--train_steps=2\n\xff\xfe\x00binary\n"},
        "bin.flags",
        "bin.flags is not a text file (byte 0xff",
    ),
    ({"self.flags": b"--flagfile={dir}/self.flags\n"}, "self.flags", "self.flags includes itself"),
    (
        {"a.flags": b"--model=mlp\n--flagfile={dir}/b.flags\n", "b.flags": b"--flagfile={dir}/a.flags\n"},
        "a.flags",
        "a.flags includes itself ({dir}/a.flags -> {dir}/b.flags -> {dir}/a.flags)",
    ),
    (
        {"top.flags": b"# comment\n--flagfile={dir}/inner.flags\n", "inner.flags": b"--seed=\xc3\x28\n"},
        "top.flags",
        "inner.flags is not a text file (byte 0xc3 at offset 7 is not UTF-8)",
    ),
]


@pytest.mark.cli
@pytest.mark.parametrize("files,given,message", FLAGFILES, ids=["binary", "self", "cycle", "nested_binary"])
def test_a_bad_flagfile_is_one_line_naming_it(tmp_path, files, given, message):
    for name, content in files.items():
        (tmp_path / name).write_bytes(content.replace(b"{dir}", str(tmp_path).encode()))
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    before = snapshot(model_dir)
    line = one_error_line(main_in_process(f"--flagfile={tmp_path / given}", f"--model_dir={model_dir}"))
    assert message.replace("{dir}", str(tmp_path)) in line, line
    assert snapshot(model_dir) == before


USER_MODULES = {
    "exits.py": "import sys\nsys.exit('no GPU found')\n",
    "odd_error.py": "class Odd(Exception):\n    def __str__(self):\n        raise RuntimeError\nraise Odd()\n",
    "no_args.py": "def build():\n    pass\n",
}
MODULE_CASES = [
    ("exits:build", "--model=exits:build: cannot import 'exits': SystemExit: no GPU found"),
    ("odd_error:build", "--model=odd_error:build: cannot import 'odd_error': Odd: <odd_error.Odd object"),
    ("no_args:build", "cannot be called as build(input_shape, num_classes); give it those two parameters"),
    ("builtins:print", "--model=builtins:print returned builtins.NoneType, not a keras.Model"),
]


@pytest.mark.cli
@pytest.mark.parametrize("model,message", MODULE_CASES, ids=[model for model, _ in MODULE_CASES])
def test_a_user_module_that_fails_oddly_is_one_line(tmp_path, monkeypatch, model, message):
    for name, source in USER_MODULES.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    before = snapshot(model_dir)
    line = one_error_line(main_in_process(f"--model={model}", "--train_steps=2", f"--model_dir={model_dir}"))
    assert message in line, line
    assert snapshot(model_dir) == before


@pytest.mark.cli
def test_a_truncated_data_file_is_refused_before_any_write(tmp_path):
    import numpy as np

    from input import write_tfrecords

    train = tmp_path / "data" / "train-0"
    write_tfrecords(str(train), np.zeros((8, 28, 28, 1), np.uint8), np.arange(8))
    train.write_bytes(train.read_bytes()[:-5])
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    before = snapshot(model_dir)
    result = main_in_process(
        "--dataset=tfrecord", f"--data_dir={train.parent}", "--train_steps=2", f"--model_dir={model_dir}"
    )
    assert f"TFRecord file {train} is truncated" in one_error_line(result)
    assert snapshot(model_dir) == before

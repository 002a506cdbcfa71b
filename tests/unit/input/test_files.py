"""`--dataset=PATH.csv` and `PATH.npz` read as a user wrote them: a CSV's header is the first
record its rows' reader parses (a quoted newline in a name included), and an .npz member is
measured before it is inflated."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from helpers import npz_bomb

from input import DataError
from input.files import csv_header, load_csv, load_npz, read_columns


def _table(path: Path, names: list[str]) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(names)
        writer.writerows([index * 0.5, index % 2] for index in range(20))
    return path


def _load(path: Path):
    return load_csv(
        str(path), label_column="y", eval_file=None, eval_fraction=0.2, label_kind=None, num_classes=None
    )


def test_a_header_quoting_a_newline_in_a_name_reads_as_the_same_table_without_it(tmp_path) -> None:
    """0/1 labels under a two-line header are 0/1 labels (they trained as a regression when the
    label kind was read skipping one line, the header's second line taken for a row)."""
    plain = _table(tmp_path / "plain.csv", ["dose", "y"])
    quoted = _table(tmp_path / "quoted.csv", ["dose\n(mg)", "y"])
    assert quoted.read_text().count("\n") == 22  # The header spans two lines.
    expected, actual = _load(plain), _load(quoted)
    assert actual.labels == expected.labels and expected.labels.kind == "multi_label"
    assert actual.labels.width == 1  # One 0/1 label: the binary classes of the plain table.
    assert csv_header(str(quoted)) == ["dose\n(mg)", "y"]
    features, others = read_columns(str(quoted), ["dose\n(mg)"], flag="predict_input")
    assert others == ["y"]
    np.testing.assert_array_equal(features[:, 0], np.arange(20, dtype=np.float32) * 0.5)


def test_a_bad_row_under_a_two_line_header_names_the_line_it_is_on(tmp_path) -> None:
    """(A text cell is no longer bad: the table is read by its columns' types, input.tables.)"""
    table = tmp_path / "t.csv"
    table.write_text('"dose\n(mg)",y\n1,0\n2,1,5\n')
    with pytest.raises(DataError, match=r"line 4 has 3 values under 2 columns"):
        _load(table)


def test_an_npz_member_whose_header_declares_gibs_is_one_line_before_it_is_read(tmp_path) -> None:
    bomb = npz_bomb(tmp_path / "bomb.npz")
    assert bomb.stat().st_size < 2000
    with pytest.raises(DataError) as error:
        load_npz(str(bomb), eval_fraction=0.2, label_kind=None, num_classes=None)
    assert str(error.value).startswith(f"--dataset={bomb}: x_train.npy inflates to 32.0 GiB (34359738368 bytes)")
    assert "\n" not in str(error.value)


def test_npz_zeros_inflating_past_the_bound_are_refused_and_under_it_load(tmp_path, monkeypatch) -> None:
    """The zip directory's sizes count as the headers do: 8 MiB of zeros are 8 KiB in the file."""
    from engine.cli.process import host_memory

    path = tmp_path / "zeros.npz"
    np.savez_compressed(path, x_train=np.zeros((2**17, 8)), y_train=np.zeros(2**17))
    assert path.stat().st_size < 100_000
    monkeypatch.setattr(host_memory, "memory_limit_bytes", lambda: 16 * 2**20)  # Half: 8 MiB.
    with pytest.raises(DataError, match=r"x_train.npy inflates to 8.0 MiB \(8388736 bytes\) from .* more than "):
        load_npz(str(path), eval_fraction=0.2, label_kind=None, num_classes=None)
    monkeypatch.setattr(host_memory, "memory_limit_bytes", lambda: 17 * 2**20)  # x_train fits, with y_train not.
    with pytest.raises(DataError, match=r"y_train.npy inflates to 1.0 MiB .*\(9.0 MiB with the arrays before"):
        load_npz(str(path), eval_fraction=0.2, label_kind=None, num_classes=None)
    monkeypatch.setattr(host_memory, "memory_limit_bytes", lambda: 20 * 2**20)
    assert load_npz(str(path), eval_fraction=0.2, label_kind=None, num_classes=None).labels.kind == "values"


def test_an_mnist_file_that_inflates_to_gibs_is_one_line(tmp_path) -> None:
    from input import get_data_source

    bomb = npz_bomb(tmp_path / "mnist.npz")
    with pytest.raises(DataError, match=rf"^MNIST's file {bomb}: x_train.npy inflates to 32.0 GiB"):
        get_data_source("mnist", image_shape=(28, 28, 1), data_dir=str(tmp_path))

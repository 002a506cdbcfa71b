"""A table as it comes: each column's type inferred from the training rows, its encoding by
Keras layers equal to the same arithmetic done by hand with pandas, every problem of a file in
one line, and a numbers-only CSV read exactly as before.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from benchmarks.tables import mixed_table
from input import DataError
from input.files import load_csv, read_table
from input.table_layers import encode_arrays, input_names, table_encoder
from input.table_source import load_table
from input.tables import Column, TableSchema, infer_schema, raw_columns


def _load(path, **overrides):
    options = {"label_column": "label", "eval_file": None, "eval_fraction": 0.2, "label_kind": None}
    return load_table(str(path), **{**options, "num_classes": None, **overrides})


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    return mixed_table(60, seed=3).astype(str)


def test_each_column_type_is_inferred_from_the_training_rows(frame) -> None:
    schema, problems = infer_schema(frame, "label", {}, "t.csv")
    assert problems == []
    types = {column.name: column.type for column in schema.columns}
    assert types == {
        "id": "identifier",
        "age": "number",
        "colour": "category",
        "member": "boolean",
        "joined": "date",
        "note": "text",
    }
    columns = {column.name: column for column in schema.columns}
    ages = pd.to_numeric(frame["age"].replace("", np.nan))
    assert columns["age"].fill == (float(ages.median()),) and columns["age"].missing
    counts = frame["colour"].value_counts()  # Most frequent first, a blank among the values.
    assert list(columns["colour"].vocabulary) == sorted(counts.index, key=lambda v: (-counts[v], v))
    assert "" in columns["colour"].vocabulary
    assert columns["joined"].parts == ("year", "month", "day", "day_of_week") and not columns["joined"].missing
    assert TableSchema.from_json(schema.as_json()) == schema


def test_the_layers_encode_as_pandas_does_by_hand(frame) -> None:
    train = frame.iloc[:40].copy()
    train.loc[train.index[0], ["age", "colour"]] = ""  # Blanks in training: a missing feature, a blank value.
    schema, _ = infer_schema(train, "label", {}, "t.csv")
    rows = frame.iloc[40:].copy()
    rows.loc[rows.index[0], "colour"] = "violet"  # Never seen in training: the unseen bucket.
    rows.loc[rows.index[1], "joined"] = ""  # A blank date: the training median of each part.
    encoded = encode_arrays(schema, raw_columns(rows, schema))
    columns = {column.name: column for column in schema.columns}
    ages = pd.to_numeric(rows["age"].replace("", np.nan))
    dates = pd.to_datetime(rows["joined"].replace("", np.nan), format="ISO8601")
    parts = columns["joined"].parts
    date_fill = dict(zip(parts, columns["joined"].fill, strict=True))
    vocabulary = list(columns["colour"].vocabulary)
    expected = []
    for position, (_, row) in enumerate(rows.iterrows()):
        values = [ages.iloc[position] if row["age"] else columns["age"].fill[0], float(row["age"] == "")]
        one_hot = [0.0] * (len(vocabulary) + 1)
        one_hot[vocabulary.index(row["colour"]) + 1 if row["colour"] in vocabulary else 0] = 1.0
        values += one_hot + [float(row["member"] == "yes")]
        date = dates.iloc[position]
        found = {"year": date.year, "month": date.month, "day": date.day, "day_of_week": date.dayofweek}
        values += [date_fill[part] if pd.isna(date) else found[part] for part in parts]
        expected.append(values)
    assert schema.feature_names()[:2] == ["age", "age.missing"]
    assert encoded.shape == (20, len(schema.feature_names()))
    np.testing.assert_allclose(encoded, np.array(expected, dtype=np.float32), rtol=1e-6)


def test_day_of_week_and_hour_match_pandas_over_centuries() -> None:
    stamps = pd.Series(pd.date_range("1899-12-25 05:00", "2101-03-03", freq="7919h"))
    texts = stamps.dt.strftime("%Y-%m-%d %H:%M")
    schema, problems = infer_schema(pd.DataFrame({"when": texts, "label": "a"}), "label", {}, "t.csv")
    assert problems == [] and schema.columns[0].parts == ("year", "month", "day", "day_of_week", "hour")
    encoded = np.asarray(table_encoder(schema)({"when": texts.to_numpy().reshape(-1, 1)}))
    expected = np.stack(
        [stamps.dt.year, stamps.dt.month, stamps.dt.day, stamps.dt.dayofweek, stamps.dt.hour], axis=1
    )
    np.testing.assert_array_equal(encoded, expected.astype(np.float32))


def test_a_mixed_csv_loads_with_class_names_and_its_blank_labels_left_out(tmp_path, frame) -> None:
    table = frame.copy()
    table.loc[table.index[:3], "label"] = ""
    table.to_csv(tmp_path / "t.csv", index=False)
    source = _load(tmp_path / "t.csv")
    schema = source.table
    assert schema.classes == ("high", "low", "mid") and schema.dropped_rows == 3
    assert source.labels.kind == "classes" and source.labels.width == 3
    assert source.num_train_examples + source.num_eval_examples == 57
    assert source.feature_shape == (len(schema.feature_names()),)
    lines = schema.describe()
    assert "3 rows left out: their label 'label' is blank" in lines
    assert lines[0].startswith("columns: age: number, blanks -> ") and max(map(len, lines)) <= 78
    assert "label 'label': 3 classes: high, low, mid" in lines
    features, labels = source.train_arrays()
    assert set(np.unique(labels)) <= {0, 1, 2} and features.dtype == np.float32
    # A Parquet file of the same rows is the same table.
    table.to_parquet(tmp_path / "t.parquet", index=False)
    parquet = _load(tmp_path / "t.parquet")
    assert parquet.table == schema
    np.testing.assert_array_equal(parquet.train_arrays()[0], features)


def test_column_types_set_a_type_or_drop_a_column(tmp_path, frame) -> None:
    frame.to_csv(tmp_path / "t.csv", index=False)
    source = _load(tmp_path / "t.csv", column_types=["member:category", "colour:drop"])
    types = {column.name: column.type for column in source.table.columns}
    assert types["member"] == "category" and types["colour"] == "drop"
    assert "colour=red" not in source.table.feature_names()


def test_text_asked_for_is_the_words_it_holds(frame) -> None:
    """Inferred free text is left out; asked for, each of its training split's words is a 0/1 feature."""
    schema, _ = infer_schema(frame, "label", {"note": "text"}, "t.csv")
    note = next(column for column in schema.columns if column.name == "note")
    counts = frame["note"].str.split().explode().value_counts()
    assert note.used and set(note.vocabulary) == set(counts.index)
    rows = pd.DataFrame({"note": ["Quick, the CAT!", "zebra", ""], "label": "a"})
    only_note = TableSchema(columns=(note,), label="label")
    encoded = encode_arrays(only_note, raw_columns(rows, only_note))
    words = list(note.vocabulary)
    expected = np.zeros((3, len(words) + 1), np.float32)
    expected[0, [words.index("quick") + 1, words.index("the") + 1, words.index("cat") + 1]] = 1.0
    expected[1, 0] = 1.0  # A word the training split never held.
    np.testing.assert_array_equal(encoded, expected)
    assert only_note.feature_names()[:2] == ["note:(other words)", f"note:{words[0]}"]


def test_columns_are_named_as_keras_and_a_saved_model_take_names() -> None:
    names = ["Body Mass (g)", "Colour/Kind", "Colour Kind", "_x", "été", "2nd"]
    schema = TableSchema(columns=tuple(Column(name, "number", fill=(0.0,)) for name in names), label="y")
    assert list(input_names(schema).values()) == [
        "Body_Mass__g_",
        "Colour_Kind",
        "Colour_Kind_2",
        "c_x",
        "c_t_",
        "c2nd",
    ]


def test_every_problem_of_a_table_is_said_in_one_line(tmp_path) -> None:
    table = pd.DataFrame(
        {
            "empty": [""] * 30,
            "when": ["2024-01-01"] * 29 + ["2024-13-45"],
            "name": [f"n{index}" for index in range(30)],
            "label": ["yes"] * 30,
        }
    )
    table.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(DataError) as error:
        _load(tmp_path / "t.csv", column_types=["name:category", "nothing:drop"], eval_fraction=0.0)
    message = str(error.value)
    assert "\n" not in message and message.startswith(
        f"--dataset={tmp_path / 't.csv'} cannot be used as it is: "
    )
    for part in (
        "--column_types names 'nothing', which is not a column",
        "column 'empty' is blank in every training row",
        "column 'when' holds '2024-13-45', which is not a date",
        "column 'name' is set to category but its 30 training rows hold 30 values",
        "the label 'label' holds one class ('yes') only",
    ):
        assert part in message, (part, message)


def test_a_bad_column_type_is_one_line(tmp_path, frame) -> None:
    frame.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(DataError, match=r"entry 'age:float' is not NAME:TYPE with TYPE one of number, boolean"):
        _load(tmp_path / "t.csv", column_types=["age:float"])


def test_a_csv_of_numbers_is_read_as_before(tmp_path) -> None:
    """No schema, the numeric reader's very arrays: a table of numbers trains as it did."""
    path = tmp_path / "n.csv"
    pd.DataFrame({"a": np.linspace(0, 1, 30), "b": np.arange(30) % 7, "label": np.arange(30) % 3}).to_csv(
        path, index=False
    )
    source = load_csv(
        str(path), label_column="label", eval_file=None, eval_fraction=0.0, label_kind=None, num_classes=None
    )
    _, features, labels = read_table(str(path), "label")
    assert source.table is None
    np.testing.assert_array_equal(source.train_arrays()[0], features)
    np.testing.assert_array_equal(source.train_arrays()[1], labels)


def test_a_column_of_numbers_or_dates_with_a_few_stray_cells_is_said_not_left_out(frame) -> None:
    """'?' among ages, a day written another way among dates: the column stays a number (a date)
    and each stray value is named with its count, where reading it as categories or an identifier
    would have left it out or lost its order with a note in passing."""
    table = frame.copy()
    table.loc[table.index[:3], "age"] = "?"  # 3 of 60: 95 % numbers.
    table.loc[table.index[4], "age"] = "n/a"
    table.loc[table.index[5], "joined"] = "31/02/2021"
    schema, problems = infer_schema(table, "label", {}, "t.csv")
    assert problems == [
        "column 'age' holds numbers but also '?' (3 rows), 'n/a' (1 row): leave a missing number's cell blank, "
        "or read the column as categories (--column_types=age:category)",
        "column 'joined' holds '31/02/2021', which is not a date "
        "(write dates as 2024-03-01 or 2024-03-01 13:45)",
    ]
    # Asked for as categories, the same column is read as the user says, with no problem.
    schema, problems = infer_schema(table, "label", {"age": "category", "joined": "drop"}, "t.csv")
    assert problems == [] and {c.name: c.type for c in schema.columns}["age"] == "category"
    # Most cells not numbers: a category column that happens to hold some, as before.
    table.loc[table.index[:30], "age"] = "unknown"
    schema, problems = infer_schema(table.drop(columns="joined"), "label", {}, "t.csv")
    assert problems == [] and {c.name: c.type for c in schema.columns}["age"] == "category"

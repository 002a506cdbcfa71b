"""engine/errors.py: what a user reads of an error is printed safely (one line, nothing that
would act on a terminal)."""

from engine.errors import printable


def test_printable_escapes_what_would_act_on_a_terminal():
    assert printable("loss\x1b[31m\r\nengine.main: error: x\u202e\t") == (
        "loss\\x1b[31m\\r\\nengine.main: error: x\\u202e\\t"
    )
    assert printable("accuracy é 0.97 [x]") == "accuracy é 0.97 [x]"

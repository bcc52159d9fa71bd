"""A processor's exception travels from its task to the driver in an authenticated envelope:
the driver loads only what a task of its own query signed, and shows anything else as text."""

from __future__ import annotations

import base64
import re

import pytest

from spark_integration.errors import ErrorKey, processor_error, user_error
from statestore.errors import ProcessorError
from tests.hostile import forged_envelopes, hostile_pickle


def spark_text(error: ProcessorError) -> RuntimeError:
    """What the driver gets from Spark: the task's failure as text, inside Spark's wrapping."""
    return RuntimeError(f"[FOREACH_BATCH_USER_FUNCTION_ERROR] An error occurred in the user provided function "
                        f"in foreach batch sink.\nPythonException: Traceback (most recent call last):\n"
                        f"  File \"tasks.py\", line 315\nstatestore.errors.ProcessorError: {error}\n")


def failure(error: Exception, key: ErrorKey) -> RuntimeError:
    try:
        raise error
    except Exception as e:
        return spark_text(processor_error(e, 3, 1, key))


def test_the_processor_exception_comes_back_as_itself():
    key = ErrorKey()
    error = ValueError("bad value: 42")
    error.add_note("raised by P.handleInputRows for key ('a',)")
    back = user_error(failure(error, key), key)
    assert type(back) is ValueError and str(back) == "bad value: 42"
    assert back.__notes__ == ["raised by P.handleInputRows for key ('a',)"]


@pytest.mark.parametrize("which", range(3))
def test_a_forged_envelope_in_the_message_is_never_loaded(tmp_path, which):
    key = ErrorKey()
    marker = tmp_path / "pwned"
    hostile = forged_envelopes(marker)[which]
    back = user_error(failure(ValueError(f"bad value: {hostile}"), key), key)
    assert not marker.exists()
    # The genuine envelope, after the forged one, still gives the processor's exception.
    assert type(back) is ValueError and str(back) == f"bad value: {hostile}"


def test_forged_envelopes_alone_give_nothing_to_load(tmp_path):
    marker = tmp_path / "pwned"
    text = RuntimeError("Job aborted: " + " ".join(forged_envelopes(marker)))
    assert user_error(text, ErrorKey()) is None
    assert not marker.exists()


def test_a_tampered_payload_is_not_loaded(tmp_path):
    key = ErrorKey()
    text = str(failure(ValueError("x"), key))
    found = re.search(r"\[icestate-exception:([A-Za-z0-9+/=]*):", text)
    payload = bytearray(base64.b64decode(found.group(1)))
    payload[len(payload) // 2] ^= 0x01
    tampered = text.replace(found.group(1), base64.b64encode(bytes(payload)).decode())
    assert user_error(RuntimeError(tampered), key) is None
    # The payload swapped for a hostile one under the genuine MAC.
    marker = tmp_path / "pwned"
    swapped = text.replace(found.group(1), base64.b64encode(hostile_pickle(marker)).decode())
    assert user_error(RuntimeError(swapped), key) is None
    assert not marker.exists()


def test_an_envelope_of_another_query_is_not_loaded():
    assert user_error(failure(ValueError("x"), ErrorKey()), ErrorKey()) is None


def test_a_truncated_envelope_is_not_loaded():
    key = ErrorKey()
    text = str(failure(ValueError("x"), key))
    for cut in (len(text) - 5, text.index(":icestate-exception]") - 3, text.index("[icestate-exception:") + 30):
        assert user_error(RuntimeError(text[:cut]), key) is None


def test_two_genuine_envelopes_give_the_first():
    key = ErrorKey()
    text = f"{failure(KeyError('first'), key)}\nand then\n{failure(ValueError('second'), key)}"
    back = user_error(RuntimeError(text), key)
    assert type(back) is KeyError and back.args == ("first",)


def test_no_key_loads_nothing():
    assert user_error(failure(ValueError("x"), ErrorKey()), None) is None


def test_an_exception_that_does_not_pickle_comes_back_as_its_text():
    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    key = ErrorKey()
    back = user_error(failure(Unpicklable("lost the file"), key), key)
    assert isinstance(back, ProcessorError)
    assert str(back).startswith("Unpicklable: lost the file\n(in batch 3, task 1)")


def test_the_key_is_never_shown():
    key = ErrorKey()
    for shown in (repr(key), str(key), str(failure(ValueError("x"), key))):
        assert key.secret.hex() not in shown and repr(key.secret) not in shown

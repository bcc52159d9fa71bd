"""Hostile content for the tests of the channels where bytes written by someone else are read
back (``docs/reliability.md``, threat model): payloads whose loading would leave a mark."""

from __future__ import annotations

import base64
import pickle
from pathlib import Path

from spark_integration.errors import ErrorKey, envelope


class Touch:
    """Unpickling this creates ``path``: the side effect a hostile payload would have if it
    were ever loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def hostile_pickle(marker: Path | str) -> bytes:
    return pickle.dumps(Touch(str(marker)))


def forged_envelopes(marker: Path | str) -> list[str]:
    """Text an attacker can put into a processor's message: the exception envelope of the old
    unsigned format, one with a made-up MAC, one signed with another query's key; each holds
    a pickle that creates ``marker``."""
    blob = base64.b64encode(hostile_pickle(marker)).decode()
    return [
        f"[icestate-exception:{blob}:icestate-exception]",
        f"[icestate-exception:{blob}:{'0' * 64}:icestate-exception]",
        envelope(hostile_pickle(marker), ErrorKey()),
    ]


MARKER_ENV = "ICESTATE_TEST_MARKER"


class MarkOnCall:
    """A class a hostile table property could name for pyiceberg to import and call (a FileIO,
    an S3 retry strategy, a location provider): calling it creates the file ``$ICESTATE_TEST_MARKER``."""

    def __init__(self, *args, **kwargs):
        import os

        with open(os.environ[MARKER_ENV], "w") as f:
            f.write("called")

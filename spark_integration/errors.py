"""A processor's exception, from the Python worker that raised it to the driver that reports it.

Spark reports a failed task to the driver as text: the worker's traceback, wrapped in Spark's
own errors (a ``PythonException``, then, from a ``foreachBatch``, a
``FOREACH_BATCH_USER_FUNCTION_ERROR`` and a ``StreamingQueryException``), the user's message
last. A task here raises ``ProcessorError``, whose message starts with the user's exception
(type, message, where: handler and key, batch and task) and ends with an *envelope*: the
exception itself, pickled, and an HMAC-SHA256 of the pickle, between markers. The driver finds
envelopes in Spark's text (``user_error``) and raises the user's own exception object, so
``query.exception()`` and ``awaitTermination()`` give it (``spark_integration.query``), Spark's
error chained as its cause.

The text is not the task's alone: the exception's message comes first, and it may quote stream
input (``raise ValueError(f"bad value: {value}")``), so anyone who can write one record can
put text shaped like an envelope into it. A pickle runs code when loaded, so the driver loads
only an envelope it can prove a task of this query wrote: the MAC is keyed with the query's
``ErrorKey``, 32 random bytes the driver makes when the query starts and ships to its tasks
inside the batch plan (the task closure, a channel executors already trust); a new start of
the query makes a new key, so an envelope seen in an earlier run's logs does not load either.
The MAC is compared in constant time. Anything that does not prove itself is never decoded:
the failure is then reported as Spark's text (``docs/reliability.md``, threat model).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field

from pyspark import cloudpickle

from statestore.errors import ProcessorError

_START, _END = "[icestate-exception:", ":icestate-exception]"
# What the MAC covers, besides the pickle: a version and a purpose, so that a MAC made with
# this key for anything else can never pass as an envelope's.
_DOMAIN = b"icestate-exception-envelope-v1\x00"
_ENVELOPE = re.compile(re.escape(_START) + r"([A-Za-z0-9+/=]*):([0-9a-f]{64})" + re.escape(_END))


@dataclass(frozen=True)
class ErrorKey:
    """The key that authenticates a query's exception envelopes (module docstring). Never
    shown: its ``repr`` says nothing of the bytes."""

    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def sign(self, payload: bytes) -> str:
        return hmac.new(self.secret, _DOMAIN + payload, hashlib.sha256).hexdigest()

    def proves(self, payload: bytes, mac: str) -> bool:
        return hmac.compare_digest(self.sign(payload), mac)


def processor_error(error: Exception, batch_id: int, task: int, key: ErrorKey) -> ProcessorError:
    """The task's error for ``error`` raised by processor code (``raise ... from error``),
    its envelope signed with the query's ``key``."""
    notes = "".join(f"\n{n}" for n in getattr(error, "__notes__", ()))
    try:
        payload = cloudpickle.dumps(error)
    except Exception:  # an exception that does not pickle still reports its text
        payload = b""
    return ProcessorError(f"{type(error).__name__}: {error}{notes}\n(in batch {batch_id}, task {task})\n"
                          f"{envelope(payload, key)}")


def envelope(payload: bytes, key: ErrorKey) -> str:
    """``payload`` between the markers, with its MAC."""
    return f"{_START}{base64.b64encode(payload).decode()}:{key.sign(payload)}{_END}"


def user_error(error: BaseException, key: ErrorKey | None) -> BaseException | None:
    """The processor's exception carried in ``error``'s text (Spark's wrapping of a failed
    task), from the first envelope there that ``key`` proves: unpickled, or a
    ``ProcessorError`` with the text before it when the exception did not pickle. None when no
    envelope proves itself (not a processor's failure, a forged envelope, no key): the caller
    then reports Spark's own error, whose text shows everything."""
    if key is None:
        return None
    text = str(error)
    for found in _ENVELOPE.finditer(text):
        try:
            payload = base64.b64decode(found.group(1), validate=True)
        except (binascii.Error, ValueError):
            continue
        if not key.proves(payload, found.group(2)):
            continue
        if payload:
            try:
                original = cloudpickle.loads(payload)  # authenticated: a task of this query wrote it
            except Exception:  # e.g. its class does not import here: its text still reports it
                original = None
            if isinstance(original, BaseException):
                return original
        head = text[:found.start()].rsplit("ProcessorError: ", 1)[-1].strip()
        return ProcessorError(head)
    return None

"""A processor's exception, from the Python worker that raised it to the driver that reports it.

Spark reports a failed task to the driver as text: the worker's traceback, wrapped in Spark's
own errors (a ``PythonException``, then, from a ``foreachBatch``, a
``FOREACH_BATCH_USER_FUNCTION_ERROR`` and a ``StreamingQueryException``), the user's message
last. A task here raises ``ProcessorError``, whose message starts with the user's exception
(type, message, where: handler and key, batch and task) and ends with the exception itself,
pickled, between markers. The driver finds it in Spark's text (``user_error``) and raises the
user's own exception object, so ``query.exception()`` and ``awaitTermination()`` give it
(``spark_integration.query``), Spark's error chained as its cause.
"""

from __future__ import annotations

import base64
import re

from pyspark import cloudpickle

from statestore.errors import ProcessorError

_START, _END = "[icestate-exception:", ":icestate-exception]"
_BLOB = re.compile(re.escape(_START) + r"([A-Za-z0-9+/=]+)" + re.escape(_END))


def processor_error(error: Exception, batch_id: int, task: int) -> ProcessorError:
    """The task's error for ``error`` raised by processor code (``raise ... from error``)."""
    notes = "".join(f"\n{n}" for n in getattr(error, "__notes__", ()))
    try:
        blob = base64.b64encode(cloudpickle.dumps(error)).decode()
    except Exception:  # an exception that does not pickle still reports its text
        blob = ""
    return ProcessorError(f"{type(error).__name__}: {error}{notes}\n(in batch {batch_id}, task {task})\n"
                          f"{_START}{blob}{_END}")


def user_error(error: BaseException) -> BaseException | None:
    """The processor's exception carried in ``error``'s text (Spark's wrapping of a failed
    task), unpickled; a ``ProcessorError`` with its text when it cannot be; None when
    ``error`` is not a processor's failure."""
    text = str(error)
    found = _BLOB.search(text)
    if found is None:
        return None
    if found.group(1):
        try:
            original = cloudpickle.loads(base64.b64decode(found.group(1)))
            if isinstance(original, BaseException):
                return original
        except Exception:
            pass
    head = text[:found.start()].rsplit("ProcessorError: ", 1)[-1].strip()
    return ProcessorError(head)

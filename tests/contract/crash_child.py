"""The child process of the contract's crash tests: ``python -m tests.contract.crash_child
<backend id> <location>``, with ``STATESTORE_CRASH_AT`` set, writes step 2 and checkpoints,
so that it dies at that crash point. It opens the table as the parent does
(``RETAIN_CHECKPOINTS``), from the backend id alone."""

from __future__ import annotations

import sys

from statestore.store import StateStore
from tests.contract.backends import BACKENDS
from tests.contract.helpers import write

RETAIN_CHECKPOINTS = 1  # so that the crashed commit also has a checkpoint to expire and files to delete

# The writes of each step: {key: value, or None to clear}.
STEPS = {
    1: {k: k for k in range(30)},
    2: {**{k: 10 * k for k in range(20, 40)}, **dict.fromkeys(range(5))},
    3: {**dict.fromkeys(range(30, 35), 1), 2: None},
}


def model(steps: list[int]) -> dict[int, int]:
    state: dict[int, int] = {}
    for step in steps:
        for k, v in STEPS[step].items():
            if v is None:
                state.pop(k, None)
            else:
                state[k] = v
    return state


def main(backend_id: str, location: str) -> None:
    backend = BACKENDS[backend_id](location)
    store = StateStore(backend.open(retain_checkpoints=RETAIN_CHECKPOINTS))
    write(store, STEPS[2])
    store.checkpoint()


if __name__ == "__main__":
    main(*sys.argv[1:])

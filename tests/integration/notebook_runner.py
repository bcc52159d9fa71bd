"""Executes a notebook in a real Jupyter kernel (nbclient driving ipykernel), as Jupyter's
"Restart and run all" does, and can write its outputs back into the file: the outputs each
committed notebook carries, images included (``image/png``).

The kernel is ipykernel's own kernelspec, whose command is this interpreter
(``sys.executable``, the project's venv when run as below): no kernelspec needs installing,
and a user-level or system-wide ``python3`` spec pointing at another Python is never used.
It starts in the repository root, so notebooks name files as the README does. Refresh the
committed outputs of notebooks, from the repository root:

    .venv/bin/python -m tests.integration.notebook_runner notebooks/quickstart.ipynb [...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
import zmq
from jupyter_client.kernelspec import NATIVE_KERNEL_NAME, KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
# Seconds one cell may run (a cell runs a whole streaming query at most).
CELL_TIMEOUT = 600
# What child processes write straight to the kernel's file descriptors (Spark's JVM logging as
# it starts) goes to this program's standard error, not into the notebook's outputs; what the
# cells print, shell lines (``!icestate ...``) included, is kept.
KERNEL_ARGUMENTS = ["--IPKernelApp.capture_fd_output=False"]


def kernel_manager() -> KernelManager:
    """A manager of a kernel run by this interpreter: ipykernel's bundled ``python3`` spec only
    (no kernel directory is searched, so no installed spec can stand in for it), its channels
    encrypted with CurveZMQ keys where libzmq and the kernel support them."""
    specs = KernelSpecManager(kernel_dirs=[], ensure_native_kernel=True)
    km = KernelManager(kernel_name=NATIVE_KERNEL_NAME, kernel_spec_manager=specs)
    if _curve_supported():  # encrypted channels, as the kernel asks for over TCP
        km.curve_publickey, km.curve_secretkey = zmq.curve_keypair()
    return km


def _curve_supported() -> bool:
    """Whether libzmq, the kernel (ipykernel 7+) and its manager all take CurveZMQ keys."""
    from ipykernel.kernelapp import IPKernelApp

    return (zmq.has("curve") and "curve_secretkey" in IPKernelApp.class_trait_names()
            and "curve_publickey" in KernelManager.class_trait_names())


def run_notebook(path: str | Path, write: bool = False) -> nbformat.NotebookNode:
    """Execute every cell of the notebook ``path`` top to bottom in a new kernel (working
    directory: the repository root) and return the executed notebook; with ``write``, store
    it, outputs included, in ``path``.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised (a failed ``assert`` included);
            the file is then left as it was.
        nbclient.exceptions.CellTimeoutError: a cell ran longer than ``CELL_TIMEOUT``.
    """
    path = Path(path)
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, km=kernel_manager(), kernel_name=NATIVE_KERNEL_NAME, timeout=CELL_TIMEOUT,
                            record_timing=False, resources={"metadata": {"path": str(ROOT)}},
                            extra_arguments=KERNEL_ARGUMENTS)
    client.execute(cleanup_kc=True)  # the kernel is shut down at the end, also after an error
    if write:
        nbformat.validate(notebook)
        nbformat.write(notebook, path)
    return notebook


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.executable} -m tests.integration.notebook_runner notebooks/NAME.ipynb [...]")
    for arg in sys.argv[1:]:
        started = time.perf_counter()
        run_notebook(arg, write=True)
        print(f"executed {arg} in {time.perf_counter() - started:.1f} s, outputs written")

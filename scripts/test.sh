#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite: lint, then pytest.
# pytest exits 5 when it collects no test; that is a failure here, as is any other non-zero code.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job against the embedded default:
# a SQLite Iceberg catalog and a local warehouse directory (./warehouse).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/icestate stream --warehouse "${WAREHOUSE:-./warehouse}" "$@"

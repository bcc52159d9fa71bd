#!/usr/bin/env bash
# Sets up everything the project needs on a fresh machine (Python 3.11+, package registries):
# Java for Spark, PostgreSQL for the catalog tests and Chromium for the state browser's tests if missing,
# a virtual environment in .venv, the project with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v java >/dev/null 2>&1; then
  echo "java not found: installing openjdk-17-jre-headless"
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q openjdk-17-jre-headless
fi
# PostgreSQL's server programs for the tests' shared-catalog server (tests/pg_server.py starts its
# own cluster in a temporary directory). Debian's package would also create and start a system
# cluster "main" on port 5432: createcluster.d tells its install to create none (so none runs).
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "PostgreSQL server not found: installing Debian's postgresql (no cluster of its own)"
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO mkdir -p /etc/postgresql-common/createcluster.d
  echo "create_main_cluster = off" | $SUDO tee /etc/postgresql-common/createcluster.d/icestate-no-main.conf >/dev/null
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q postgresql
fi
# Debian's Chromium and its driver for the browser tests of `icestate ui` (tests/catalog/test_ui.py
# drives /usr/bin/chromium with Playwright; Playwright's own browser downloads are never used).
if [ ! -x /usr/bin/chromium ]; then
  echo "chromium not found: installing Debian's chromium and chromium-driver"
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q chromium chromium-driver
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# uv installs the same releases as pip from the same registry in under half the time (59 against
# 135 s in a fresh environment here), byte-compiled as pip does; pip itself when uv cannot be had.
if .venv/bin/python -m pip install -q uv; then
  .venv/bin/uv pip install --python .venv/bin/python -q --compile-bytecode -e '.[test,bench]'
else
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test,bench]'
fi
# An editable install leaves the project's own modules uncompiled, and where
# PYTHONDONTWRITEBYTECODE is set (this machine's sandbox sets it) every Python process compiled
# them again at import: 0.3 CPU-s for the task path alone, in each Spark Python worker, CLI call
# and driver. Compiled once here (an edited file is compiled again in memory, as ever).
PYTHONDONTWRITEBYTECODE= .venv/bin/python -m compileall -q -j 0 icestate_pyspark_path.py statestore catalog spark_integration benchmarks tests
# A regular install puts icestate_pyspark_path.pth into site-packages (setup.py); an editable
# one does not: copied here, so Spark's Python processes import the installed pyspark.
cp icestate_pyspark_path.pth "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"

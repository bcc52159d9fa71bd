#!/usr/bin/env bash
# Sets up everything the project needs on a fresh machine (Python 3.11+, package registries):
# Java for Spark if missing, a virtual environment in .venv, the project with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v java >/dev/null 2>&1; then
  echo "java not found: installing openjdk-17-jre-headless"
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q openjdk-17-jre-headless
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,bench]'

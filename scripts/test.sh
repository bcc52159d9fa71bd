#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite: lint, then pytest in parallel
# processes (pytest-xdist, longest tests first, see tests/conftest.py; one more than cores, at most 4:
# ICESTATE_TEST_WORKERS sets it).
#   --fast   only the tests that start no Spark, are not marked slow and were quick in the recorded run
#            (tests/conftest.py): under 3 minutes, for editing.
# Other arguments go to pytest. pytest exits 5 when it collects no test; that is a failure here, as
# is any other non-zero code.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# The class-data-sharing archive of the tests' JVMs (tests/jvm_archive.py), written once per
# environment (some 40 s): every Spark JVM of the suite then starts on about 40 % less CPU. The
# fast tier starts no JVM.
case " $* " in
  *" --fast "*) ;;
  *) .venv/bin/python -m tests.jvm_archive ;;
esac
# One process more than cores: with one per core the CPU stayed 17 % idle (tests that wait: the
# short soak, sleeping interpreters, fault injection); 3 on 2 cores: 16.3 min, all passed.
workers=${ICESTATE_TEST_WORKERS:-$(($(nproc) + 1))}
if [ "$workers" -gt 4 ]; then workers=4; fi
# The run's temporary files (Spark's local directories, the JVMs' native libraries, the Connect
# server's artifacts, the tests' tables) go under one directory, removed at the end when the run
# passed: drivers the tests kill cannot clean up after themselves (tests/conftest.py points the
# JVMs there too).
# Others may pass through it (not list it): the PostgreSQL server runs as its own user.
TMPDIR=$(mktemp -d "${TMPDIR:-/tmp}/icestate-tests-XXXXXX")
chmod 711 "$TMPDIR"
export TMPDIR
status=0
# loadfile: each process is handed the next test file when it is free, the files with the most
# recorded seconds first (tests/conftest.py), a file's tests together (its module-scoped fixtures
# set up once). xdist's "load" hands each process a quarter of its share of consecutive tests at
# once: the first process got all the longest tests and ran them one after another.
# --no-loadscope-reorder keeps the order tests/conftest.py gives.
# --basetemp: the tests' folders directly in it (paths no longer than pytest's own default gives).
# PYTHONDONTWRITEBYTECODE emptied: pytest keeps the test modules it rewrote for their asserts
# (each process collects every file: 9 against 4 CPU-s a collection), as do the run's other
# processes for anything set-up did not compile.
PYTHONDONTWRITEBYTECODE= .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder \
  --basetemp "$TMPDIR/t" "$@" || status=$?
if [ "$status" -eq 0 ]; then rm -rf "$TMPDIR"; else echo "scripts/test.sh: the run's temporary files are kept in $TMPDIR"; fi
echo "scripts/test.sh: set up, linted and tested in $((SECONDS / 60)) min $((SECONDS % 60)) s (exit $status)"
exit "$status"

#!/usr/bin/env bash
# The test suite, as CI runs it: installs, starts Kafka and Redis on
# 127.0.0.1, lints and type-checks, then runs every tier (tests/unit,
# tests/kafka, tests/pipeline, tests/faults; the last two drive real Conveyor
# processes against the real broker and Redis). Extra arguments go to pytest.
#
#   bash infra/test.sh            everything (CI, the README's command)
#   bash infra/test.sh --fast     the unit tier alone: no Kafka, no Redis, seconds
#
# Test files run in parallel processes (pytest-xdist, a file's tests in one
# process, so its module fixtures are built once): CONVEYOR_TEST_PROCESSES,
# default 4 for everything (most of a fault test is waiting on a broker or a
# timeout, so four overlap well on two cores) and 2 for the unit tier
# (CPU-bound); 0 runs everything in this process.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ "${1:-}" = "--fast" ]; then
  shift
  bash infra/install.sh --dev
  .venv/bin/ruff check .
  exec .venv/bin/python -m pytest -q -p no:cacheprovider \
    -n "${CONVEYOR_TEST_PROCESSES:-2}" --dist loadfile tests/unit "$@"
fi
bash infra/install.sh --dev
bash infra/kafka.sh start
bash infra/redis.sh start
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 \
  -n "${CONVEYOR_TEST_PROCESSES:-4}" --dist loadfile "$@"

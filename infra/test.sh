#!/usr/bin/env bash
# The test suite, as CI runs it: installs, starts Kafka and Redis on
# 127.0.0.1, lints and type-checks, then runs every test (the integration
# tests drive real Conveyor processes against the real broker and Redis).
# Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash infra/install.sh --dev
bash infra/kafka.sh start
bash infra/redis.sh start
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"

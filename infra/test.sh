#!/usr/bin/env bash
# The test suite, as CI runs it: installs, starts Kafka and Redis on
# 127.0.0.1, lints, type-checks and builds the docs site (mkdocs --strict), runs
# the smoke of a runtime-only install (infra/smoke.sh), then runs every tier (tests/unit,
# tests/kafka, tests/pipeline, tests/faults; the last two drive real Conveyor
# processes against the real broker and Redis), then the vllm tier (tests/vllm:
# vLLM's engine for real, from the environment infra/vllm.sh builds once and a
# fresh clone reuses; CONVEYOR_TEST_VLLM=0 leaves it out). Extra arguments go to
# pytest, and run the vllm tier only when they name it.
#
#   bash infra/test.sh              everything (CI, the README's command)
#   bash infra/test.sh --fast       the unit tier alone: no Kafka, no Redis, seconds
#   bash infra/test.sh tests/vllm   the vllm tier alone (Kafka and Redis too)
#
# Test files run in parallel processes (pytest-xdist, a file's tests in one
# process, so its module fixtures are built once): CONVEYOR_TEST_PROCESSES,
# default 2 on two cores for the tiers that use the broker, 3 for the unit
# tier; 0 runs everything in this process. Three took the kafka, pipeline,
# faults and engines tiers in 12 min 42 s against 17 min 32 s in two (much
# of a fault test is waiting, which a third process fills), but on two
# cores each of the last three full runs in three processes failed one test
# whose broker call or event loop was seconds late (a lookup's timeout
# delivered at 7.0 s of 5, a topic list that missed new topics, a read that
# got nothing in 20 s), each passing at once alone: the third process's
# minutes are not worth a red run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ "${1:-}" = "--fast" ]; then
  shift
  bash infra/install.sh --dev
  .venv/bin/ruff check .
  NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
  exec .venv/bin/python -m pytest -q -p no:cacheprovider \
    -n "${CONVEYOR_TEST_PROCESSES:-3}" --dist loadfile tests/unit "$@"
fi
bash infra/install.sh --dev
bash infra/kafka.sh start
bash infra/redis.sh start
.venv/bin/ruff check .
.venv/bin/mypy
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
vllm_tier() {
  bash infra/vllm.sh
  HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m pytest -q -p no:cacheprovider --durations=10 "$@"
}
case "${1:-}" in
  tests/vllm*) vllm_tier "$@"; exit ;;
esac
# the install users get (runtime dependencies only), started and driven by the openai client
if [ $# -eq 0 ]; then
  bash infra/smoke.sh
fi
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 \
  -n "${CONVEYOR_TEST_PROCESSES:-2}" --dist loadfile "$@"
if [ $# -eq 0 ] && [ "${CONVEYOR_TEST_VLLM:-1}" != 0 ]; then
  vllm_tier tests/vllm
fi

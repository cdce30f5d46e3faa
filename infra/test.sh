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
# default 3 for a tier run alone and for the unit tier alone (--fast); in the
# full run 2 beside the vllm tier and 4 for the fault and pipeline tiers after
# it; 0 runs everything in this process. The full run overlaps the vllm tier (one process) with the steps
# that keep no time: lint, types, docs, the smoke, the unit tier, then the
# kafka and engines tiers. The pipeline and fault tiers, whose tests count
# seconds, start after all of them and run alone. The vllm tier's output is
# kept in a file and printed when it ends. Where the time goes, and what was
# tried: docs/benchmarks/results/test-suite.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# when each step of the full run ended, in seconds from the start: where CI's time goes
mark() { echo "--- $1 at ${SECONDS} s"; }
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
mark "the install, Kafka and Redis"
# mypy's cache outside the clone: a fresh clone is checked in a second, not ten
# (a file whose stamp changed is compared by its hash; a changed one is read again)
export MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/conveyor/mypy}
checks() {
  .venv/bin/ruff check . &&
    .venv/bin/mypy &&
    NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
}
vllm_tier() {
  # the tier's tests start the engine at once: vllm.sh's one-token proof is a start more
  CONVEYOR_VLLM_PROBE=0 bash infra/vllm.sh
  HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m pytest -q -p no:cacheprovider --durations=10 "$@"
}
broker_tiers() {
  .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 \
    -n "${CONVEYOR_TEST_PROCESSES:-3}" --dist loadfile "$@"
}
if [ $# -gt 0 ]; then
  checks
  case "$1" in
    tests/vllm*) vllm_tier "$@" ;;
    *) broker_tiers "$@" ;;
  esac
  exit
fi
# the full run: the vllm tier in the background, beside the steps that keep no time
vllm_pid=
if [ "${CONVEYOR_TEST_VLLM:-1}" != 0 ]; then
  vllm_log=$(mktemp "${TMPDIR:-/tmp}/conveyor-vllm-tier.XXXXXX")
  (set -e; vllm_tier tests/vllm) >"$vllm_log" 2>&1 &
  vllm_pid=$!
fi
vllm_done() {
  [ -n "$vllm_pid" ] || return 0
  local code=0
  wait "$vllm_pid" || code=$?
  echo "--- the vllm tier (tests/vllm, run beside the steps before): exit $code"
  cat "$vllm_log"
  rm -f "$vllm_log"
  return $code
}
status=0
# lint, types, docs, and the install users get (runtime dependencies only,
# started and driven by the openai client): a failure ends the run
if ! { checks && mark "lint, types and docs" && bash infra/smoke.sh; }; then
  vllm_done || true
  exit 1
fi
mark "the smoke"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=5 \
  -n "${CONVEYOR_TEST_PROCESSES:-2}" --dist loadfile tests/unit || status=$?
mark "the unit tier"
# the kafka and engines tiers (no Conveyor started, no fault timed) in the time
# the vllm tier still takes
broker_tiers tests/kafka tests/engines -n 2 || status=$?
mark "the kafka and engines tiers"
vllm_done || status=$?
mark "the vllm tier"
# the fault and pipeline tiers, alone on the machine now, the faults first, in four
# processes: their tests wait on purpose (a third to a half of the CPU idle in three)
broker_tiers tests/faults tests/pipeline -n "${CONVEYOR_TEST_PROCESSES:-4}" || status=$?
mark "the fault and pipeline tiers"
exit $status

#!/usr/bin/env bash
# Installs what Conveyor needs on a fresh Debian machine, idempotently:
# Java 17 and Maven (for the Kafka jars), redis-server, and a Python venv in
# ./.venv with Conveyor and its dependencies (llama-cpp-python builds from
# source once for a portable CPU level, see infra/llama.sh).
#
#   infra/install.sh         runtime dependencies
#   infra/install.sh --dev   plus the test and lint tools
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

apt_install() {
  local missing=()
  command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
  command -v mvn >/dev/null || missing+=(maven)
  command -v redis-server >/dev/null || missing+=(redis-server)
  command -v patch >/dev/null || missing+=(patch)  # infra/llama.sh patches llama.cpp
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}" >/dev/null
}

apt_install
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
# llama-cpp-python first, from a wheel built for a portable CPU level (infra/llama.sh),
# so that pip never builds (or takes from its cache) a -march=native one
bash infra/llama.sh .venv/bin/python install
.venv/bin/pip install -q -e ".${extra}"
bash infra/llama.sh .venv/bin/python check
bash infra/kafka.sh fetch

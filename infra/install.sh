#!/usr/bin/env bash
# Installs what Conveyor needs on a fresh Debian machine, idempotently:
# Java 17 and Maven (for the Kafka jars), redis-server, and a Python venv in
# ./.venv (CONVEYOR_VENV names another) with Conveyor and the exact versions of
# its dependencies that infra/requirements/ locks (installed by uv, infra/uv.sh;
# llama-cpp-python builds from source once for a portable CPU level, see
# infra/llama.sh). `bash infra/lock.sh --upgrade` moves the lock forward.
#
#   infra/install.sh         runtime dependencies (infra/requirements/runtime.txt)
#   infra/install.sh --dev   plus the test, lint and docs tools (infra/requirements/dev.txt)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

apt_install() {
  local missing=()
  command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
  command -v mvn >/dev/null || missing+=(maven)
  command -v redis-server >/dev/null || missing+=(redis-server)
  command -v patch >/dev/null || missing+=(patch)  # infra/llama.sh patches llama.cpp
  # the console's browser tests drive Debian's chromium (Playwright's own browser
  # download is not used)
  if [ "${1:-}" = "--dev" ]; then command -v chromium >/dev/null || missing+=(chromium); fi
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}" >/dev/null
}

apt_install "${1:-}"
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
venv=${CONVEYOR_VENV:-.venv}
uv=$(bash infra/uv.sh)
if [ ! -x "$venv/bin/python" ]; then
  # with pip in it (--seed): infra/llama.sh builds its wheel with pip, once
  "$uv" venv -q --seed --python "$python" "$venv"
fi
lock=infra/requirements/runtime.txt
[ "${1:-}" = "--dev" ] && lock=infra/requirements/dev.txt
# llama-cpp-python first, from a wheel built for a portable CPU level (infra/llama.sh):
# the lock pins the same version, so uv keeps it and never builds a -march=native one
bash infra/llama.sh "$venv/bin/python" install
# the lock's versions exactly, then Conveyor itself
"$uv" pip install -q --python "$venv/bin/python" -r "$lock"
"$uv" pip install -q --python "$venv/bin/python" --no-deps -e .
# every module's bytecode up front (uv writes none, and nothing is written where
# PYTHONDONTWRITEBYTECODE is set): a process that compiles fastapi, redis and the rest
# from source at each start took twice as long to start (docs/operating/install.md)
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$venv/bin/python" -m compileall -q -j0 "$site" cli conveyor gateway schemas topics workers bench \
  >/dev/null || true
bash infra/llama.sh "$venv/bin/python" check
bash infra/kafka.sh fetch

#!/usr/bin/env bash
# Resolves Conveyor's dependencies and writes the lock files infra/install.sh
# installs from: infra/requirements/dev.txt (pyproject.toml's runtime dependencies
# and its dev extra) and infra/requirements/runtime.txt (the runtime dependencies
# alone, held to dev.txt's versions, so what the tests ran on is what users get).
# Both are resolved for every platform at once (uv's universal resolution), with
# llama-cpp-python pinned to the version infra/llama.sh builds (pins.txt).
#
#   bash infra/lock.sh              resolve again after pyproject.toml changed
#   bash infra/lock.sh --upgrade    upgrade every package to its newest allowed version
#
# Docs: docs/operating/install.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
uv=$(bash infra/uv.sh)
llama=$(sed -n 's/^version=\${CONVEYOR_LLAMA_VERSION:-\(.*\)}$/\1/p' infra/llama.sh)
[ -n "$llama" ] || { echo "infra/lock.sh: no llama-cpp-python version in infra/llama.sh" >&2; exit 1; }
pins=infra/requirements/pins.txt
printf '# written by infra/lock.sh: the version infra/llama.sh builds\nllama-cpp-python==%s\n' \
  "$llama" >"$pins"
compile() {
  "$uv" pip compile -q --universal --python-version 3.11 --no-header --annotation-style line \
    -c "$pins" "$@"
}
compile "${@}" --extra dev pyproject.toml -o infra/requirements/dev.txt
compile -c infra/requirements/dev.txt pyproject.toml -o infra/requirements/runtime.txt
echo "locked: infra/requirements/runtime.txt ($(grep -c '==' infra/requirements/runtime.txt) packages)," \
  "infra/requirements/dev.txt ($(grep -c '==' infra/requirements/dev.txt))"

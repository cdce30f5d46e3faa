#!/usr/bin/env bash
# Prints the path of uv, the installer infra/install.sh and infra/lock.sh use,
# installing the pinned version once into ~/.cache/conveyor/uv-VERSION when it is
# not there (from PyPI, with the machine's Python and pip).
set -euo pipefail
version=${CONVEYOR_UV_VERSION:-0.13.9}
dir=${XDG_CACHE_HOME:-$HOME/.cache}/conveyor/uv-$version
if [ ! -x "$dir/bin/uv" ]; then
  python=${PYTHON:-python3.11}
  command -v "$python" >/dev/null || python=python3
  rm -rf "$dir.tmp"
  "$python" -m venv "$dir.tmp" >&2
  "$dir.tmp/bin/pip" install -q --disable-pip-version-check "uv==$version" >&2
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
echo "$dir/bin/uv"

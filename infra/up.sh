#!/usr/bin/env bash
# Conveyor end to end on this machine: installs, starts a local Kafka (KRaft)
# and Redis on 127.0.0.1, then the layers, one CPU infer worker serving
# SmolLM2-135M-Instruct and the gateway on http://127.0.0.1:8000/v1.
# Ctrl-C stops Conveyor; `bash infra/kafka.sh stop; bash infra/redis.sh stop`
# stops the services. Extra arguments go to `conveyor up`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash infra/install.sh
exec .venv/bin/conveyor up "$@"

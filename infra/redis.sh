#!/usr/bin/env bash
# A local redis-server (Debian's package) bound to 127.0.0.1, with its
# append-only file on (fsync every second), so a restart keeps task claims,
# leases and counters. Conveyor's answers never depend on Redis keeping them
# (the log is the record), but a Redis that forgets makes retries slower.
#
#   infra/redis.sh start | stop | status
#
# stop stops only a Redis this script started under the same CONVEYOR_HOME (its
# pid file), as infra/kafka.sh does: a clone's CI run that found Redis already
# running leaves it running.
#
# Environment: CONVEYOR_HOME (default ./.conveyor), REDIS_PORT (6379).
set -euo pipefail
home=${CONVEYOR_HOME:-$(pwd)/.conveyor}
port=${REDIS_PORT:-6379}
rdir="$home/redis"

install() {
  command -v redis-server >/dev/null && return 0
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null
  else
    sudo apt-get update -q >/dev/null && sudo apt-get install -y -q redis-server >/dev/null
  fi
}

answers() { redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; }

start() {
  install
  if answers; then echo "redis already running on 127.0.0.1:$port"; return 0; fi
  mkdir -p "$rdir"
  redis-server --bind 127.0.0.1 --port "$port" --daemonize yes --dir "$rdir" \
    --pidfile "$rdir/redis-$port.pid" --logfile "$rdir/redis-$port.log" \
    --save "" --appendonly yes --appendfsync everysec
  for _ in $(seq 1 50); do answers && { echo "redis serving on 127.0.0.1:$port"; return 0; }; sleep 0.1; done
  echo "redis did not answer" >&2; return 1
}

stop() {
  local pidfile="$rdir/redis-$port.pid"
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    redis-cli -h 127.0.0.1 -p "$port" shutdown >/dev/null 2>&1 || true
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) answers ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac

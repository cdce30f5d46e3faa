#!/usr/bin/env bash
# A local single-node Apache Kafka (KRaft: broker + controller in one JVM)
# bound to 127.0.0.1, from the official release jars on Maven Central.
#
#   infra/kafka.sh fetch   resolve the jars into $CONVEYOR_HOME/kafka/libs (cached)
#   infra/kafka.sh start   fetch, format storage once, start, wait until it serves
#   infra/kafka.sh stop    stop the broker started here
#   infra/kafka.sh status  exit 0 when the broker answers
#
# Environment: CONVEYOR_HOME (default ./.conveyor), KAFKA_PORT (9092),
# KAFKA_CONTROLLER_PORT (9093), KAFKA_HEAP (2g: a test run creates thousands of partitions),
# KAFKA_JVM_OPTS (-XX:+UseG1GC; infra/services.py gives the brokers tests restart quicker flags),
# KAFKA_NETWORK_THREADS and KAFKA_IO_THREADS (1 and 1: two cores).
# The JVM maps its classes from an archive beside the jars once one is recorded
# (infra/kafka-cds.sh): a start then costs about 40 % less CPU.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
home=${CONVEYOR_HOME:-$(pwd)/.conveyor}
port=${KAFKA_PORT:-9092}
cport=${KAFKA_CONTROLLER_PORT:-9093}
heap=${KAFKA_HEAP:-2g}
kdir="$home/kafka"
libs="$kdir/libs"
data="$kdir/data-$port"
pidfile="$kdir/kafka-$port.pid"
# shellcheck source=infra/kafka-cds.sh
. "$here/kafka-cds.sh"

fetch() {
  if [ -f "$libs/.complete" ] && cmp -s "$here/kafka/pom.xml" "$libs/.complete"; then return 0; fi
  mkdir -p "$libs"
  rm -f "$libs"/*.jar "$libs"/.kafka-*  # the class archive too: it names the old jars
  mvn -q -B -f "$here/kafka/pom.xml" dependency:copy-dependencies \
    -DoutputDirectory="$libs" -DincludeScope=runtime
  rm -f "$libs"/slf4j-api-1.*.jar
  cp "$here/kafka/pom.xml" "$libs/.complete"
}

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; }

running() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

start() {
  fetch
  if answers; then echo "kafka already serving on 127.0.0.1:$port"; return 0; fi
  mkdir -p "$data"
  cat >"$kdir/server-$port.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$cport
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$data
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
log.retention.hours=24
# a small machine: one network and one I/O thread, less switching between
# them (bench.profile at c=32, four alternating pairs against 2 and 2: 10-21 %
# more requests a second, the broker's CPU a request 13-28 % lower; c=1 alike)
num.network.threads=${KAFKA_NETWORK_THREADS:-1}
num.io.threads=${KAFKA_IO_THREADS:-1}
PROPS
  local cp
  cp=$(cds_classpath "$libs")
  cds_flags "$libs"
  if [ ! -f "$data/meta.properties" ]; then
    # shellcheck disable=SC2086  # lists of flags
    cid=$(java ${KAFKA_JVM_OPTS:-} $cds_use -cp "$cp" kafka.tools.StorageTool random-uuid \
      2>/dev/null | tail -n 1)
    # shellcheck disable=SC2086
    java ${KAFKA_JVM_OPTS:-} $cds_use -cp "$cp" kafka.tools.StorageTool format -t "$cid" \
      -c "$kdir/server-$port.properties" >/dev/null
  fi
  # shellcheck disable=SC2086  # KAFKA_JVM_OPTS and cds_opts are lists of flags
  nohup java "-Xmx$heap" "-Xms$heap" ${KAFKA_JVM_OPTS:--XX:+UseG1GC} $cds_opts \
    -Dlog4j2.configurationFile="$here/kafka/log4j2.yaml" \
    -cp "$cp" kafka.Kafka "$kdir/server-$port.properties" \
    >"$kdir/kafka-$port.log" 2>&1 &
  echo $! >"$pidfile"
  cds_started "$(cat "$pidfile")"
  for _ in $(seq 1 120); do
    if answers; then echo "kafka serving on 127.0.0.1:$port"; return 0; fi
    running || { tail -n 30 "$kdir/kafka-$port.log"; echo "kafka exited" >&2; return 1; }
    sleep 0.5
  done
  echo "kafka did not answer within 60 s" >&2
  return 1
}

stop() {
  if running; then
    kill "$(cat "$pidfile")"
    for _ in $(seq 1 60); do running || break; sleep 0.5; done
    running && kill -9 "$(cat "$pidfile")"
  fi
  rm -f "$pidfile"
}

case "${1:-}" in
  fetch) fetch ;;
  start) start ;;
  stop) stop ;;
  status) answers ;;
  *) echo "usage: $0 fetch|start|stop|status" >&2; exit 2 ;;
esac

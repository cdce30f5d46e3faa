#!/usr/bin/env bash
# A local three-node Apache Kafka cluster on 127.0.0.1 (KRaft: each JVM is a
# broker and one of three controller voters), to run Conveyor against
# replicated topics and to lose a broker on purpose. Same jars as
# infra/kafka.sh; the single node on 9092 is not touched.
#
#   infra/kafka-cluster.sh start      fetch, format each node once (one cluster id), start,
#                                     wait until every node serves
#   infra/kafka-cluster.sh stop       stop the nodes started here
#   infra/kafka-cluster.sh status     exit 0 when every node answers
#   infra/kafka-cluster.sh bootstrap  print the value for CONVEYOR_KAFKA_BOOTSTRAP
#
# Node N's files: $CONVEYOR_HOME/kafka-cluster/node-<port>/ (data, server.properties,
# kafka.log, kafka.pid). Environment: CONVEYOR_HOME (default ./.conveyor),
# KAFKA_CLUSTER_PORTS ("19092 19094 19096"), KAFKA_CLUSTER_CONTROLLER_PORTS
# ("19093 19095 19097"), KAFKA_HEAP (384m), KAFKA_LIBS (default
# $CONVEYOR_HOME/kafka/libs), KAFKA_JVM_OPTS (more JVM options).
#
# Every internal topic is replicated three times with min.insync.replicas 2, and a
# node that stops heartbeating is fenced after 3 s (the default is 9 s), so its
# partitions' leadership moves and the in-sync sets shrink quickly.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
home=${CONVEYOR_HOME:-$(pwd)/.conveyor}
read -r -a ports <<<"${KAFKA_CLUSTER_PORTS:-19092 19094 19096}"
read -r -a cports <<<"${KAFKA_CLUSTER_CONTROLLER_PORTS:-19093 19095 19097}"
heap=${KAFKA_HEAP:-384m}
libs=${KAFKA_LIBS:-$home/kafka/libs}
cdir="$home/kafka-cluster"
# shellcheck source=infra/kafka-cds.sh
. "$here/kafka-cds.sh"

if [ "${#ports[@]}" -ne "${#cports[@]}" ]; then
  echo "KAFKA_CLUSTER_PORTS and KAFKA_CLUSTER_CONTROLLER_PORTS differ in length" >&2
  exit 2
fi
n=${#ports[@]}
replicas=$((n < 3 ? n : 3))
min_isr=$((replicas >= 3 ? 2 : 1))

fetch() {
  if [ -f "$libs/.complete" ]; then return 0; fi
  CONVEYOR_HOME="$home" bash "$here/kafka.sh" fetch
  libs="$home/kafka/libs"
}

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

node_dir() { echo "$cdir/node-$1"; }

running() {
  local pidfile
  pidfile="$(node_dir "$1")/kafka.pid"
  [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

voters() {
  local out="" i
  for i in "${!ports[@]}"; do out+="${out:+,}$((i + 1))@127.0.0.1:${cports[$i]}"; done
  echo "$out"
}

bootstrap() {
  local out="" p
  for p in "${ports[@]}"; do out+="${out:+,}127.0.0.1:$p"; done
  echo "$out"
}

write_properties() {  # index
  local i=$1 port=${ports[$1]} cport=${cports[$1]} dir
  dir=$(node_dir "$port")
  mkdir -p "$dir/data"
  cat >"$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=$((i + 1))
controller.quorum.voters=$(voters)
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$dir/data
num.partitions=1
default.replication.factor=$replicas
min.insync.replicas=$min_isr
auto.create.topics.enable=false
unclean.leader.election.enable=false
offsets.topic.replication.factor=$replicas
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=$replicas
transaction.state.log.min.isr=$min_isr
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
broker.session.timeout.ms=3000
broker.heartbeat.interval.ms=500
replica.lag.time.max.ms=10000
log.retention.hours=24
num.network.threads=${KAFKA_NETWORK_THREADS:-1}
num.io.threads=${KAFKA_IO_THREADS:-2}
num.replica.fetchers=1
PROPS
}

start() {
  fetch
  mkdir -p "$cdir"
  if [ ! -f "$cdir/cluster.id" ]; then
    java -cp "$(cds_classpath "$libs")" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1 \
      >"$cdir/cluster.id"
  fi
  local cid i port dir cp
  cid=$(cat "$cdir/cluster.id")
  cp=$(cds_classpath "$libs")
  for i in "${!ports[@]}"; do
    port=${ports[$i]}
    dir=$(node_dir "$port")
    if running "$port"; then continue; fi
    write_properties "$i"
    cds_flags "$libs"
    if [ ! -f "$dir/data/meta.properties" ]; then
      # shellcheck disable=SC2086
      java $cds_use -cp "$cp" kafka.tools.StorageTool format -t "$cid" \
        -c "$dir/server.properties" >/dev/null
    fi
    # shellcheck disable=SC2086  # KAFKA_JVM_OPTS and cds_opts are lists of flags
    nohup java "-Xmx$heap" "-Xms$heap" -XX:+UseG1GC ${KAFKA_JVM_OPTS:-} $cds_opts \
      -Dlog4j2.configurationFile="$here/kafka/log4j2.yaml" \
      -cp "$cp" kafka.Kafka "$dir/server.properties" >"$dir/kafka.log" 2>&1 &
    echo $! >"$dir/kafka.pid"
    cds_started "$!"
  done
  local waiting
  for _ in $(seq 1 240); do
    waiting=0
    for port in "${ports[@]}"; do
      if ! running "$port"; then
        tail -n 30 "$(node_dir "$port")/kafka.log" >&2
        echo "kafka node on $port exited" >&2
        return 1
      fi
      answers "$port" || waiting=1
    done
    if [ $waiting = 0 ]; then echo "kafka cluster serving on $(bootstrap)"; return 0; fi
    sleep 0.5
  done
  echo "the kafka cluster did not answer within 120 s" >&2
  return 1
}

stop() {
  local port pidfile
  for port in "${ports[@]}"; do
    pidfile="$(node_dir "$port")/kafka.pid"
    if running "$port"; then kill "$(cat "$pidfile")"; fi
  done
  for port in "${ports[@]}"; do
    pidfile="$(node_dir "$port")/kafka.pid"
    for _ in $(seq 1 60); do running "$port" || break; sleep 0.5; done
    if running "$port"; then kill -9 "$(cat "$pidfile")"; fi
    rm -f "$pidfile"
  done
}

status() {
  local port
  for port in "${ports[@]}"; do answers "$port" || return 1; done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  bootstrap) bootstrap ;;
  *) echo "usage: $0 start|stop|status|bootstrap" >&2; exit 2 ;;
esac

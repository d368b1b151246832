#!/usr/bin/env bash
# Real Kafka (KRaft, one combined broker+controller), PostgreSQL and Redis as plain processes on
# loopback, for the integration tests and local development. No Docker.
#
#   scripts/services.sh start  [kafka|postgres|redis ...]   start (no-op for what already runs)
#   scripts/services.sh stop   [kafka|postgres|redis ...]   stop (fine when already stopped)
#   scripts/services.sh status [kafka|postgres|redis ...]   one line each; exit 1 if any is down
#   scripts/services.sh env                                 export lines for eval
#   scripts/services.sh install                             fetch/install what start needs
#
# Data, logs and pid files live under .services/ (gitignored). Ports and paths come from:
#   FIRSTTOKEN_KAFKA_PORT (19092)  FIRSTTOKEN_KAFKA_CONTROLLER_PORT (19093)
#   FIRSTTOKEN_PG_PORT (15432)     FIRSTTOKEN_REDIS_PORT (16379)
#   FIRSTTOKEN_SERVICES_DIR (.services)  FIRSTTOKEN_KAFKA_HEAP (-Xms512m -Xmx512m -Xmn160m)
#   FIRSTTOKEN_KAFKA_GC (-XX:+UseParallelGC)
#   FIRSTTOKEN_PG_BIN (directory holding pg_ctl; found by itself otherwise)
# Credentials: Kafka's listeners (the clients' and the controller's) take SASL/PLAIN only (user
# `firsttoken`), Redis starts with a password (requirepass) and a new PostgreSQL data directory
# with password authentication (scram-sha-256, no trust); the passwords are drawn once into
# .services/credentials (mode 600; FIRSTTOKEN_KAFKA_PASSWORD / FIRSTTOKEN_REDIS_PASSWORD /
# FIRSTTOKEN_PG_PASSWORD override) and `env` puts them in the URLs (Kafka's as
# FIRSTTOKEN_KAFKA_USERNAME / FIRSTTOKEN_KAFKA_PASSWORD). A service started before credentials
# existed (no auth marker: .services/kafka/sasl, .services/redis/auth.conf, <postgres
# dir>/password) keeps running as it is, and `env` gives it without a password until it is
# restarted.
# Kafka's jars come from Maven Central through scripts/kafka/pom.xml (cached in ~/.m2 and under
# .services/); PostgreSQL and Redis come from Debian packages, installed when missing and root.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
HOST=127.0.0.1
KAFKA_PORT=${FIRSTTOKEN_KAFKA_PORT:-19092}
KAFKA_CONTROLLER_PORT=${FIRSTTOKEN_KAFKA_CONTROLLER_PORT:-19093}
PG_PORT=${FIRSTTOKEN_PG_PORT:-15432}
REDIS_PORT=${FIRSTTOKEN_REDIS_PORT:-16379}
SERVICES_DIR=${FIRSTTOKEN_SERVICES_DIR:-$ROOT/.services}
KAFKA_HEAP=${FIRSTTOKEN_KAFKA_HEAP:--Xms512m -Xmx512m -Xmn160m}
# The parallel collector: on the 2-core box G1 paused the broker 12-30 ms every 3-10 s under the
# pipeline benchmark (young and remark pauses), the parallel one 14-44 ms every 40-60 s: fewer
# jobs land in a pause (bench/results/pipeline-2026-11-30-run5.md).
KAFKA_GC=${FIRSTTOKEN_KAFKA_GC:--XX:+UseParallelGC}
PG_DB=firsttoken
PG_USER=firsttoken

KAFKA_VERSION=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$ROOT/scripts/kafka/pom.xml")
KAFKA_DIR=$SERVICES_DIR/kafka
KAFKA_USER=firsttoken
KAFKA_JARS=$SERVICES_DIR/kafka-jars-$KAFKA_VERSION
REDIS_DIR=$SERVICES_DIR/redis
CREDENTIALS=$SERVICES_DIR/credentials

say() { echo "services: $*" >&2; }
die() { say "error: $*"; exit 1; }

# --- helpers -------------------------------------------------------------------------------------

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

port_busy() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

# wait_for SECONDS DESCRIPTION COMMAND...: retry COMMAND every 0.2 s until it succeeds.
wait_for() {
  local secs=$1 what=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then return 1; fi
    sleep 0.2
  done
}

apt_install() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    die "$1 is missing; install the Debian package(s) '${*:2}' (needs root and apt-get)"
  fi
  say "$1 is missing: apt-get install ${*:2}"
  if [ ! -f "$SERVICES_DIR/.apt-updated" ]; then
    apt-get update -qq >&2 || die "apt-get update failed"
    mkdir -p "$SERVICES_DIR" && touch "$SERVICES_DIR/.apt-updated"
  fi
  # policy-rc.d 101: the packages must not start their own system-wide server instances.
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; made_policy=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${@:2}" >&2 || {
    [ "$made_policy" = 1 ] && rm -f "$policy"; die "apt-get install ${*:2} failed"; }
  if [ "$made_policy" = 1 ]; then rm -f "$policy"; fi
}

# credential NAME: the password NAME (KAFKA, REDIS or PG) from FIRSTTOKEN_<NAME>_PASSWORD, else from
# .services/credentials, where one is drawn the first time (hex: no quoting needed anywhere).
credential() {
  local var=FIRSTTOKEN_$1_PASSWORD
  if [ -n "${!var:-}" ]; then echo "${!var}"; return; fi
  mkdir -p "$SERVICES_DIR"
  if ! grep -q "^$var=" "$CREDENTIALS" 2>/dev/null; then
    (umask 077; echo "$var=$(python3 -c 'import secrets; print(secrets.token_hex(24))')" >> "$CREDENTIALS")
  fi
  chmod 600 "$CREDENTIALS"
  sed -n "s/^$var=//p" "$CREDENTIALS" | tail -n 1
}

# --- Kafka ---------------------------------------------------------------------------------------

kafka_install() {
  command -v java >/dev/null || apt_install java openjdk-17-jre-headless
  command -v mvn >/dev/null || apt_install maven maven
  if [ -f "$KAFKA_JARS/.complete" ]; then return; fi
  say "fetching Apache Kafka $KAFKA_VERSION jars from Maven Central (once; cached in ~/.m2)"
  rm -rf "$KAFKA_JARS"
  mkdir -p "$KAFKA_JARS"
  mkdir -p "$KAFKA_DIR"
  mvn -q -B -Dstyle.color=never -f "$ROOT/scripts/kafka/pom.xml" dependency:copy-dependencies \
    -DoutputDirectory="$KAFKA_JARS" -DincludeScope=runtime > "$KAFKA_DIR/mvn.log" 2>&1 \
    || { cat "$KAFKA_DIR/mvn.log" >&2; die "mvn could not fetch the Kafka jars (output above)"; }
  touch "$KAFKA_JARS/.complete"
}

kafka_write_config() {
  mkdir -p "$KAFKA_DIR/data"
  local pw jaas
  pw=$(credential KAFKA)
  # the password sits inside a quoted JAAS value: a quote, a backslash or a line break would break it
  case $pw in *[\"\\]* | *$'\n'* | "") die "FIRSTTOKEN_KAFKA_PASSWORD may not be empty or hold \", \\ or a line break";; esac
  jaas="org.apache.kafka.common.security.plain.PlainLoginModule required username=\"$KAFKA_USER\" password=\"$pw\" user_$KAFKA_USER=\"$pw\";"
  # the password is in this file and the marker: mode 600 both (made anew: an older file kept its mode)
  rm -f "$KAFKA_DIR/server.properties" "$KAFKA_DIR/sasl"
  (umask 077; cat > "$KAFKA_DIR/server.properties" <<EOF
# Written by scripts/services.sh on each start: a single node, broker and controller in one
# process, tuned for tests on a small machine. Both listeners take SASL/PLAIN only: the one user
# (the clients, and the node itself between its broker and controller halves) and its password.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$KAFKA_CONTROLLER_PORT
listeners=SASL_PLAINTEXT://$HOST:$KAFKA_PORT,CONTROLLER://$HOST:$KAFKA_CONTROLLER_PORT
advertised.listeners=SASL_PLAINTEXT://$HOST:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=SASL_PLAINTEXT
listener.security.protocol.map=CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT
sasl.enabled.mechanisms=PLAIN
sasl.mechanism.inter.broker.protocol=PLAIN
sasl.mechanism.controller.protocol=PLAIN
listener.name.sasl_plaintext.plain.sasl.jaas.config=$jaas
listener.name.controller.plain.sasl.jaas.config=$jaas
log.dirs=$KAFKA_DIR/data
num.partitions=1
# Topics are created by the code that needs them, with the partition count it asks for.
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=2
background.threads=2
log.retention.hours=24
# One job message may be up to 9 MiB (schemas/limits.py MAX_MESSAGE_BYTES: an 8 MiB line and what
# the server adds): the producer sends record batches of up to 10 MiB (pipeline/queue/kafka.py
# MAX_BATCH_BYTES), and the broker takes them.
message.max.bytes=10485760
replica.fetch.max.bytes=10485760
EOF
  )
  # the marker `env` and the readiness probe read: this broker's user and password
  (umask 077; printf '%s\n%s\n' "$KAFKA_USER" "$pw" > "$KAFKA_DIR/sasl")
  cat > "$KAFKA_DIR/log4j2.properties" <<EOF
appender.file.type = File
appender.file.name = file
appender.file.fileName = $KAFKA_DIR/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
EOF
}

# JVM options for every Kafka java command, in the array KAFKA_JVM.
kafka_jvm_opts() {
  # shellcheck disable=SC2206  # KAFKA_HEAP and KAFKA_GC are lists of JVM options
  KAFKA_JVM=($KAFKA_HEAP $KAFKA_GC -XX:+ExitOnOutOfMemoryError
    -Djava.awt.headless=true "-Dlog4j2.configurationFile=$KAFKA_DIR/log4j2.properties"
    -cp "$KAFKA_JARS/*")
}

# (a broker started before Kafka had credentials has no marker: it is probed without)
kafka_ready() {
  if [ -f "$KAFKA_DIR/sasl" ]; then
    python3 "$ROOT/scripts/kafka/probe.py" "$HOST" "$KAFKA_PORT" "$KAFKA_DIR/sasl"
  else
    python3 "$ROOT/scripts/kafka/probe.py" "$HOST" "$KAFKA_PORT"
  fi
}

# The running broker's password (empty for one started before Kafka had credentials).
kafka_password() { if [ -f "$KAFKA_DIR/sasl" ]; then sed -n 2p "$KAFKA_DIR/sasl"; fi; }

kafka_launch() {
  if pid_alive "$KAFKA_DIR/kafka.pid"; then return; fi
  rm -f "$KAFKA_DIR/kafka.pid"
  if port_busy "$KAFKA_PORT" || port_busy "$KAFKA_CONTROLLER_PORT"; then
    die "port $KAFKA_PORT or $KAFKA_CONTROLLER_PORT is taken by another process; set FIRSTTOKEN_KAFKA_PORT / FIRSTTOKEN_KAFKA_CONTROLLER_PORT"
  fi
  kafka_install
  kafka_write_config
  kafka_jvm_opts
  if [ ! -f "$KAFKA_DIR/data/meta.properties" ]; then
    local cluster_id
    # a base64 id may start with "-", which the tool's argument parser takes for an option (1 run
    # in 64 failed so): pass it as --cluster-id=ID, and draw ids that start with a letter or digit
    cluster_id=$(python3 -c 'import base64, uuid
while True:
    s = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    if s[0].isalnum():
        print(s)
        break')
    java "${KAFKA_JVM[@]}" kafka.tools.StorageTool format --cluster-id="$cluster_id" -c "$KAFKA_DIR/server.properties" \
      > "$KAFKA_DIR/format.log" 2>&1 || { cat "$KAFKA_DIR/format.log" >&2; die "kafka storage format failed"; }
  fi
  say "starting Kafka $KAFKA_VERSION on $HOST:$KAFKA_PORT"
  # setsid: the broker outlives this shell and is not hit by the caller's Ctrl-C. (A script has no
  # job control, so setsid does not fork: it execs java, and $! is the JVM's pid.)
  setsid java "${KAFKA_JVM[@]}" kafka.Kafka "$KAFKA_DIR/server.properties" > "$KAFKA_DIR/stdout.log" 2>&1 < /dev/null &
  echo $! > "$KAFKA_DIR/kafka.pid"
}

kafka_wait() {
  if wait_for 90 kafka kafka_ready; then
    say "Kafka ready on $HOST:$KAFKA_PORT"
    return
  fi
  tail -n 20 "$KAFKA_DIR/stdout.log" "$KAFKA_DIR/server.log" >&2 2>/dev/null || true
  die "Kafka did not answer a metadata request within 90 s (logs: $KAFKA_DIR)"
}

kafka_stop() {
  local pidfile=$KAFKA_DIR/kafka.pid
  if ! pid_alive "$pidfile"; then rm -f "$pidfile"; say "Kafka is not running"; return; fi
  local pid; pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || true
  if ! wait_for 30 "kafka exit" bash -c "! kill -0 $pid"; then
    say "Kafka did not stop within 30 s: killing it"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile" "$KAFKA_DIR/sasl"
  say "Kafka stopped"
}

kafka_status() {
  if pid_alive "$KAFKA_DIR/kafka.pid" && kafka_ready; then
    echo "kafka     up    $HOST:$KAFKA_PORT (pid $(cat "$KAFKA_DIR/kafka.pid"))"
  else
    echo "kafka     down"; return 1
  fi
}

# --- PostgreSQL ----------------------------------------------------------------------------------

pg_bin() {
  if [ -n "${FIRSTTOKEN_PG_BIN:-}" ]; then echo "$FIRSTTOKEN_PG_BIN"; return; fi
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$d" ] && [ -x "$d/pg_ctl" ]; then echo "$d"; return; fi
  if command -v pg_ctl >/dev/null; then dirname "$(command -v pg_ctl)"; return; fi
}

pg_install() {
  if [ -z "$(pg_bin)" ]; then apt_install PostgreSQL postgresql; fi
  [ -n "$(pg_bin)" ] || die "PostgreSQL binaries not found; set FIRSTTOKEN_PG_BIN to the directory holding pg_ctl"
}

# The server refuses to run as root: as root it runs as the 'postgres' system user, in a data
# directory that user owns. If that user cannot reach .services (e.g. a checkout under /root),
# the data goes to a directory under /tmp named after this checkout.
pg_as() {
  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
    (cd / && runuser -u postgres -- "$@")  # from /: the postgres user may not reach the caller's cwd
  else
    "$@"
  fi
}

pg_dir() {
  local d=$SERVICES_DIR/postgres
  mkdir -p "$d"
  if [ "$(id -u)" = 0 ]; then
    chown postgres "$d" 2>/dev/null || true
    if ! runuser -u postgres -- test -w "$d" 2>/dev/null; then
      d=/tmp/firsttoken-postgres-$(echo "$ROOT" | sha256sum | cut -c1-12)
      mkdir -p "$d"; chown postgres "$d"; chmod 700 "$d"
    fi
  fi
  echo "$d"
}

pg_ready() { "$(pg_bin)/pg_isready" -q -h "$HOST" -p "$PG_PORT" -d "$PG_DB" -U "$PG_USER"; }

# The password of a data directory made with password authentication (empty for an older one made
# with trust); psql and createdb get it through PGPASSWORD.
pg_password() {  # (without pg_dir's side effects: `env` creates nothing)
  cat "$SERVICES_DIR/postgres/password" 2>/dev/null \
    || cat "/tmp/firsttoken-postgres-$(echo "$ROOT" | sha256sum | cut -c1-12)/password" 2>/dev/null || true
}

pg_start() {
  pg_install
  local bin dir; bin=$(pg_bin); dir=$(pg_dir)
  if pg_as "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
    pg_ready || wait_for 30 postgres pg_ready || die "PostgreSQL runs but does not accept connections"
    return
  fi
  if port_busy "$PG_PORT"; then die "port $PG_PORT is taken by another process; set FIRSTTOKEN_PG_PORT"; fi
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    say "initdb PostgreSQL data in $dir/data (password authentication)"
    local pw pwfile=$dir/initdb.pw
    pw=$(credential PG)
    (umask 077; echo "$pw" > "$pwfile")
    if [ "$(id -u)" = 0 ]; then chown postgres "$pwfile"; fi
    pg_as "$bin/initdb" -D "$dir/data" -U "$PG_USER" --auth=scram-sha-256 --pwfile="$pwfile" -E UTF8 --no-locale \
      > "$dir/initdb.log" 2>&1 || { rm -f "$pwfile"; cat "$dir/initdb.log" >&2; die "initdb failed"; }
    rm -f "$pwfile"
    (umask 077; echo "$pw" > "$dir/password")
    cat >> "$dir/data/postgresql.conf" <<'EOF'
# scripts/services.sh: a throwaway test database; durability across an OS crash is not needed.
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = 64MB
max_connections = 200
EOF
  fi
  say "starting PostgreSQL on $HOST:$PG_PORT"
  pg_as "$bin/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -t 60 \
    -o "-p $PG_PORT -c listen_addresses=$HOST -c unix_socket_directories=''" start >/dev/null \
    || { tail -n 20 "$dir/postgres.log" >&2; die "PostgreSQL did not start (log: $dir/postgres.log)"; }
  wait_for 30 postgres bash -c "'$bin/pg_isready' -q -h $HOST -p $PG_PORT" || die "PostgreSQL does not answer pg_isready"
  if ! PGPASSWORD=$(pg_password) "$bin/psql" -h "$HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres -tAc \
      "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'" | grep -q 1; then
    PGPASSWORD=$(pg_password) "$bin/createdb" -h "$HOST" -p "$PG_PORT" -U "$PG_USER" "$PG_DB"
  fi
  say "PostgreSQL ready on $HOST:$PG_PORT (database $PG_DB)"
}

pg_stop() {
  local bin; bin=$(pg_bin)
  if [ -z "$bin" ]; then say "PostgreSQL is not installed"; return; fi
  local dir; dir=$(pg_dir)
  if ! pg_as "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then say "PostgreSQL is not running"; return; fi
  pg_as "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >/dev/null
  say "PostgreSQL stopped"
}

pg_status() {
  local bin; bin=$(pg_bin)
  if [ -n "$bin" ] && pg_ready; then echo "postgres  up    $HOST:$PG_PORT/$PG_DB"; else echo "postgres  down"; return 1; fi
}

# --- Redis ---------------------------------------------------------------------------------------

# The password of the Redis started here (empty for one started before credentials existed).
redis_password() { sed -n 's/^requirepass //p' "$REDIS_DIR/auth.conf" 2>/dev/null || true; }

redis_ping() { [ "$(REDISCLI_AUTH=$(redis_password) redis-cli -h "$HOST" -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ]; }

redis_start() {
  command -v redis-server >/dev/null && command -v redis-cli >/dev/null || apt_install Redis redis-server
  if pid_alive "$REDIS_DIR/redis.pid" && redis_ping; then return; fi
  if port_busy "$REDIS_PORT"; then die "port $REDIS_PORT is taken by another process; set FIRSTTOKEN_REDIS_PORT"; fi
  mkdir -p "$REDIS_DIR"
  # the password in a file of mode 600, not on the command line (ps shows that to every user)
  (umask 077; echo "requirepass $(credential REDIS)" > "$REDIS_DIR/auth.conf")
  say "starting Redis on $HOST:$REDIS_PORT (password required)"
  redis-server "$REDIS_DIR/auth.conf" --bind "$HOST" --port "$REDIS_PORT" --dir "$REDIS_DIR" --daemonize yes \
    --pidfile "$REDIS_DIR/redis.pid" --logfile "$REDIS_DIR/redis.log" --save '' --appendonly no \
    || die "redis-server did not start (log: $REDIS_DIR/redis.log)"
  wait_for 20 redis redis_ping || die "Redis does not answer PING (log: $REDIS_DIR/redis.log)"
  say "Redis ready on $HOST:$REDIS_PORT"
}

redis_stop() {
  if ! pid_alive "$REDIS_DIR/redis.pid"; then rm -f "$REDIS_DIR/redis.pid"; say "Redis is not running"; return; fi
  local pid; pid=$(cat "$REDIS_DIR/redis.pid")
  kill -TERM "$pid" 2>/dev/null || true
  wait_for 10 "redis exit" bash -c "! kill -0 $pid" || kill -KILL "$pid" 2>/dev/null || true
  rm -f "$REDIS_DIR/redis.pid" "$REDIS_DIR/auth.conf"
  say "Redis stopped"
}

redis_status() {
  if command -v redis-cli >/dev/null && redis_ping; then echo "redis     up    $HOST:$REDIS_PORT"; else echo "redis     down"; return 1; fi
}

# --- commands ------------------------------------------------------------------------------------

print_env() {
  local pg_pw redis_pw kafka_pw
  pg_pw=$(pg_password); redis_pw=$(redis_password); kafka_pw=$(kafka_password)
  echo "export FIRSTTOKEN_KAFKA_BOOTSTRAP=$HOST:$KAFKA_PORT"
  if [ -n "$kafka_pw" ]; then
    echo "export FIRSTTOKEN_KAFKA_USERNAME=$KAFKA_USER FIRSTTOKEN_KAFKA_PASSWORD=$kafka_pw"
  else
    echo "unset FIRSTTOKEN_KAFKA_USERNAME FIRSTTOKEN_KAFKA_PASSWORD"
  fi
  echo "export FIRSTTOKEN_DATABASE_URL=postgresql+psycopg://$PG_USER${pg_pw:+:$pg_pw}@$HOST:$PG_PORT/$PG_DB"
  echo "export FIRSTTOKEN_REDIS_URL=redis://${redis_pw:+:$redis_pw@}$HOST:$REDIS_PORT/0"
}

services_of() {
  if [ $# -eq 0 ]; then echo "kafka postgres redis"; return; fi
  local s
  for s in "$@"; do
    case $s in kafka|postgres|redis) ;; *) die "unknown service '$s' (kafka, postgres, redis)";; esac
  done
  echo "$*"
}

has() { [[ " $1 " == *" $2 "* ]]; }

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
  start)
    wanted=$(services_of "$@")
    mkdir -p "$SERVICES_DIR"
    t0=$SECONDS
    # Kafka's JVM takes the longest to come up: launch it first and wait for it last.
    if has "$wanted" kafka; then kafka_launch; fi
    if has "$wanted" postgres; then pg_start; fi
    if has "$wanted" redis; then redis_start; fi
    if has "$wanted" kafka; then kafka_wait; fi
    say "started ($wanted) in $((SECONDS - t0)) s"
    ;;
  stop)
    wanted=$(services_of "$@")
    if has "$wanted" kafka; then kafka_stop; fi
    if has "$wanted" postgres; then pg_stop; fi
    if has "$wanted" redis; then redis_stop; fi
    ;;
  status)
    wanted=$(services_of "$@")
    rc=0
    if has "$wanted" kafka; then kafka_status || rc=1; fi
    if has "$wanted" postgres; then pg_status || rc=1; fi
    if has "$wanted" redis; then redis_status || rc=1; fi
    exit $rc
    ;;
  env)
    print_env
    ;;
  install)
    mkdir -p "$SERVICES_DIR"
    kafka_install
    pg_install
    command -v redis-server >/dev/null || apt_install Redis redis-server
    ;;
  *)
    echo "usage: scripts/services.sh start|stop|status [kafka|postgres|redis ...] | env | install" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Start the services stockade's integration tests and distributed mode use
# (Debian/Ubuntu, run as root, no systemd needed):
#
#   redis     redis-server on 127.0.0.1:6379, daemonized         (check: redis-cli ping)
#   postgres  PostgreSQL (Debian `postgresql`, 15 on bookworm) on 127.0.0.1:5432,
#             role `stockade` / password `stockade`, database `stockade` (check: pg_isready)
#   docker    dockerd + the runsc runtime: delegates to setup-docker.sh
#
#   scripts/start-services.sh [redis] [postgres] [docker]      (no argument = all)
#
# Packages are apt-installed when missing.  Idempotent: services already answering
# are left alone, so a second run is a fast no-op.  Messages go to stderr.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REDIS_PORT=6379
PG_PORT=5432
PG_ROLE=stockade PG_PASSWORD=stockade PG_DB=stockade
WAIT_S=${STOCKADE_SERVICE_TIMEOUT:-30}

log() { printf 'start-services: %s\n' "$*" >&2; }
die() { printf 'start-services: ERROR: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (installs packages, starts services as their users)"

APT_UPDATED=0
ensure_pkgs() {   # ensure_pkgs pkg...   (apt-get update at most once per run)
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    export DEBIAN_FRONTEND=noninteractive
    if ((!APT_UPDATED)); then
        log "apt-get update"
        apt-get update -qq >&2 || die "apt-get update failed"
        APT_UPDATED=1
    fi
    log "installing ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
        || die "apt-get install ${missing[*]} failed"
}

wait_for() {   # wait_for WHAT CMD...   polls CMD until it succeeds or WAIT_S passes
    local what=$1 deadline=$((SECONDS + WAIT_S)); shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "$what did not answer within ${WAIT_S}s"
        sleep 0.2
    done
}

# ------------------------------------------------------------------ redis ---
redis_ok() { [[ $(redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null) == PONG ]]; }

start_redis() {
    if command -v redis-cli >/dev/null && redis_ok; then
        log "redis: already answering on 127.0.0.1:$REDIS_PORT"
        return 0
    fi
    ensure_pkgs redis-server
    if redis_ok; then   # the package's maintainer script may have started it
        log "redis: answering on 127.0.0.1:$REDIS_PORT"
        return 0
    fi
    if (exec 3<>"/dev/tcp/127.0.0.1/$REDIS_PORT") 2>/dev/null; then
        die "redis: port $REDIS_PORT is taken by something that does not answer PING"
    fi
    install -d -o redis -g redis -m 0750 /run/redis /var/lib/redis /var/log/redis
    local conf=()
    [[ -r /etc/redis/redis.conf ]] && conf=(/etc/redis/redis.conf)
    log "redis: starting redis-server on 127.0.0.1:$REDIS_PORT"
    runuser -u redis -- redis-server "${conf[@]}" \
        --bind 127.0.0.1 --port "$REDIS_PORT" --protected-mode yes \
        --daemonize yes --supervised no \
        --pidfile /run/redis/redis-server.pid --logfile /var/log/redis/redis-server.log \
        --dir /var/lib/redis >&2 \
        || die "redis-server failed to start (log: /var/log/redis/redis-server.log)"
    wait_for "redis (log: /var/log/redis/redis-server.log)" redis_ok
    log "redis: up"
}

# --------------------------------------------------------------- postgres ---
pg_ok() { pg_isready -q -h 127.0.0.1 -p "$PG_PORT"; }
as_postgres() { (cd / && runuser -u postgres -- "$@"); }
psql_q() { as_postgres psql -X -q -t -A -p "$PG_PORT" -d postgres -v ON_ERROR_STOP=1 -c "$1"; }

ensure_pg_objects() {
    if [[ $(psql_q "SELECT 1 FROM pg_roles WHERE rolname = '$PG_ROLE'") != 1 ]]; then
        log "postgres: creating role $PG_ROLE"
        psql_q "CREATE ROLE $PG_ROLE LOGIN PASSWORD '$PG_PASSWORD'" >/dev/null
    fi
    if [[ $(psql_q "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'") != 1 ]]; then
        log "postgres: creating database $PG_DB"
        as_postgres createdb -p "$PG_PORT" -O "$PG_ROLE" "$PG_DB"
    fi
}

start_postgres() {
    if command -v pg_isready >/dev/null && pg_ok; then
        ensure_pg_objects
        log "postgres: already answering on 127.0.0.1:$PG_PORT"
        return 0
    fi
    ensure_pkgs postgresql
    local ver name=main
    ver=$(find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' 2>/dev/null | sort -n | tail -n1)
    [[ -n $ver && -x /usr/lib/postgresql/$ver/bin/postgres ]] || die "postgres: no server binaries under /usr/lib/postgresql"

    # the cluster (Debian's postgresql-common layout: /etc/postgresql/VER/NAME)
    if [[ ! -f /etc/postgresql/$ver/$name/postgresql.conf ]]; then
        log "postgres: creating cluster $ver/$name"
        pg_createcluster --port "$PG_PORT" "$ver" "$name" >&2 || die "pg_createcluster $ver $name failed"
    fi
    # port stays in postgresql.conf (pg_lsclusters/pg_ctlcluster read it there);
    # listen_addresses goes to a conf.d drop-in (pg_conftool does not quote IPs)
    local port dropin=/etc/postgresql/$ver/$name/conf.d/stockade.conf
    port=$(pg_conftool -s "$ver" "$name" show port 2>/dev/null || true)
    if [[ $port != "$PG_PORT" ]]; then
        log "postgres: setting port $PG_PORT"
        pg_conftool "$ver" "$name" set port "$PG_PORT"
    fi
    if ! grep -qx "listen_addresses = '127.0.0.1'" "$dropin" 2>/dev/null; then
        grep -q "^include_dir = 'conf.d'" "/etc/postgresql/$ver/$name/postgresql.conf" \
            || die "postgres: /etc/postgresql/$ver/$name/postgresql.conf does not include conf.d/"
        log "postgres: listen_addresses 127.0.0.1 ($dropin)"
        install -d -o postgres -g postgres "$(dirname "$dropin")"
        printf "# written by stockade scripts/start-services.sh\nlisten_addresses = '127.0.0.1'\n" >"$dropin"
        chown postgres:postgres "$dropin"
    fi

    local action=start
    if [[ $(pg_lsclusters -h "$ver" "$name" 2>/dev/null | awk '{ print $4 }') == online* ]]; then
        action=restart     # running, but not on 127.0.0.1:$PG_PORT (settings changed above)
    elif (exec 3<>"/dev/tcp/127.0.0.1/$PG_PORT") 2>/dev/null; then
        die "postgres: port $PG_PORT is taken by something that is not a ready PostgreSQL"
    fi
    log "postgres: ${action}ing cluster $ver/$name on 127.0.0.1:$PG_PORT"
    # pg_ctlcluster runs pg_ctl as the cluster owner and copes with a stale postmaster.pid
    pg_ctlcluster "$ver" "$name" "$action" >&2 \
        || die "pg_ctlcluster $ver $name $action failed (log: /var/log/postgresql/postgresql-$ver-$name.log)"
    wait_for "postgres (log: /var/log/postgresql/postgresql-$ver-$name.log)" pg_ok
    ensure_pg_objects
    log "postgres: up (postgresql://$PG_ROLE:$PG_PASSWORD@127.0.0.1:$PG_PORT/$PG_DB)"
}

# ----------------------------------------------------------------- docker ---
start_docker() { "$HERE/setup-docker.sh"; }

# ------------------------------------------------------------------- main ---
(($#)) || set -- redis postgres docker
for svc in "$@"; do
    case $svc in
        redis|postgres|docker) ;;
        postgresql) ;;
        *) die "unknown service '$svc' (choose from: redis postgres docker)" ;;
    esac
done
for svc in "$@"; do
    case $svc in
        redis) start_redis ;;
        postgres|postgresql) start_postgres ;;
        docker) start_docker ;;
    esac
done

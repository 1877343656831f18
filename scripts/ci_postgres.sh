#!/usr/bin/env bash
# A throwaway PostgreSQL server on 127.0.0.1 for the multi-process storage tests (tests/test_postgres.py).
#
#   scripts/ci_postgres.sh start DIR [PORT]   install if needed, initdb in DIR, start; prints the URL
#   scripts/ci_postgres.sh stop DIR           stop the server of DIR
#
# The server trusts local connections, listens on 127.0.0.1 only and keeps everything (data, socket,
# log) under DIR. initdb and pg_ctl refuse to run as root: as root they run as the postgres user.
set -euo pipefail

cmd=${1:?usage: ci_postgres.sh start|stop DIR [PORT]}
dir=$(realpath -m "${2:?usage: ci_postgres.sh start|stop DIR [PORT]}")
port=${3:-54329}

pg_bin() {
  local found
  found=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$found" ]; then echo "$found"; elif command -v initdb >/dev/null; then dirname "$(command -v initdb)"; fi
}

as_owner() {  # run a PostgreSQL tool as the owner of the data folder
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

bin=$(pg_bin)
if [ "$cmd" = stop ]; then
  [ -n "$bin" ] && [ -d "$dir/data" ] && as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null || true
  exit 0
fi
[ "$cmd" = start ] || { echo "ci_postgres.sh: unknown command $cmd (start|stop)" >&2; exit 2; }

if [ -z "$bin" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "ci_postgres.sh: installing postgresql" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null
    bin=$(pg_bin)
  fi
  [ -n "$bin" ] || { echo "ci_postgres.sh: PostgreSQL is not installed (apt-get install postgresql)" >&2; exit 3; }
fi

mkdir -p "$dir"
if [ "$(id -u)" = 0 ]; then chown postgres "$dir"; fi
if [ ! -f "$dir/data/PG_VERSION" ]; then
  as_owner "$bin/initdb" -D "$dir/data" -U postgres --auth=trust --no-sync >"$dir/initdb.log"
fi
if ! as_owner "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then  # already running: reuse it
  as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off" start >/dev/null
fi
as_owner "$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -qtAc \
  "SELECT 1 FROM pg_database WHERE datname = 'pdltune'" | grep -q 1 ||
  as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres pdltune
echo "postgresql://postgres@127.0.0.1:$port/pdltune"

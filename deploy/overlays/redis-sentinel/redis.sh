# Starts one Redis of the Sentinel-managed pair (StatefulSet megaserve-redis, pods 0 and 1).
# The server's own flags are the arguments (the StatefulSet's args: AOF on /data, ...); this
# adds whom to replicate: the primary the Sentinels name, else (no Sentinel answers) a peer
# that already is a primary, else pod 0 (the very first start).
set -eu
self="$(hostname).megaserve-redis-headless"
primary=""
for i in 0 1 2; do
  s="megaserve-redis-sentinel-$i.megaserve-redis-sentinel"
  primary="$(timeout 3 redis-cli -h "$s" -p 26379 --raw \
    SENTINEL get-master-addr-by-name megaserve 2>/dev/null | head -n 1)" || primary=""
  [ -n "$primary" ] && break
done
if [ -z "$primary" ]; then
  for i in 0 1; do
    peer="megaserve-redis-$i.megaserve-redis-headless"
    [ "$peer" = "$self" ] && continue
    if timeout 3 redis-cli -h "$peer" INFO replication 2>/dev/null | grep -q '^role:master'; then
      primary="$peer"
    fi
  done
fi
[ -n "$primary" ] || primary="megaserve-redis-0.megaserve-redis-headless"
set -- "$@" --replica-announce-ip "$self"
if [ "$primary" != "$self" ]; then
  echo "starting as a replica of $primary"
  set -- "$@" --replicaof "$primary" 6379
else
  echo "starting as the primary"
fi
exec redis-server "$@"

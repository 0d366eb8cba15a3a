# Starts one Sentinel (StatefulSet megaserve-redis-sentinel, pods 0-2). Sentinel rewrites its
# config file, so a fresh one is written to the pod's emptyDir at every start, monitoring the
# primary the other Sentinels know, else (none answers) the Redis pod that says it is the
# primary, else pod 0 of megaserve-redis (the very first start). Peers and Redis pods are
# addressed by their stable DNS names (announce-hostnames), not by pod IPs that change.
set -eu
self="$(hostname).megaserve-redis-sentinel"
primary=""
for i in 0 1 2; do
  peer="megaserve-redis-sentinel-$i.megaserve-redis-sentinel"
  [ "$peer" = "$self" ] && continue
  primary="$(timeout 3 redis-cli -h "$peer" -p 26379 --raw \
    SENTINEL get-master-addr-by-name megaserve 2>/dev/null | head -n 1)" || primary=""
  [ -n "$primary" ] && break
done
if [ -z "$primary" ]; then
  for i in 0 1; do
    host="megaserve-redis-$i.megaserve-redis-headless"
    if timeout 3 redis-cli -h "$host" INFO replication 2>/dev/null | grep -q '^role:master'; then
      primary="$host"
      break
    fi
  done
fi
[ -n "$primary" ] || primary="megaserve-redis-0.megaserve-redis-headless"
until getent hosts "$primary" >/dev/null; do  # "sentinel monitor" needs it to resolve
  echo "waiting for $primary to resolve"
  sleep 2
done
echo "monitoring $primary"
# down-after 2 s: with the election a failover takes about 3-5 s, within the workers' 5 s
# heartbeat TTL, so their records (replicated to the new primary) outlive the failover.
cat > /data/sentinel.conf <<EOF
port 26379
dir /data
protected-mode no
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $self
sentinel monitor megaserve $primary 6379 2
sentinel down-after-milliseconds megaserve 2000
sentinel failover-timeout megaserve 30000
sentinel parallel-syncs megaserve 1
EOF
exec redis-server /data/sentinel.conf --sentinel

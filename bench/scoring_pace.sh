#!/usr/bin/env bash
# Side by side on real processes (ADRs 0070-0072): two README runs at once, one made with
# `run create --no-score-work`, the other as the README makes it (the z test, ADR 0072), each a
# bootstrap, the creator's `join` and one more volunteer on loopback; after MINUTES both are
# stopped with Ctrl-C and the certified versions each made from its first are printed with
# their rate and the ratio (scored / plain).
#
#   bench/scoring_pace.sh [MINUTES] [OUT_DIR]     (defaults: 10, /tmp/scoring_pace)
#
# Ports 31999/18080 and 32099/18180 must be free. Each run lives in OUT_DIR/{plain,scored}
# with its own HOME (keys, state), and its logs there.
set -euo pipefail
MINUTES=${1:-10}
OUT=${2:-/tmp/scoring_pace}
BIN=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin

start_run() {  # NAME BOOT_PORT HTTP_PORT [run create flags...]
  local name=$1 bp=$2 hp=$3 d addr
  shift 3
  d=$OUT/$name
  rm -rf "$d" && mkdir -p "$d/h" "$d/v1"
  (
    export HOME=$d/h PATH=$BIN:$PATH
    p2pdiloco bootstrap --port "$bp" --http-port "$hp" >"$d/boot.log" 2>&1 &
    echo $! >"$d/pids"
    for _ in $(seq 1 120); do
      addr=$(grep -o "/ip4/127.0.0.1/tcp/$bp/p2p/[A-Za-z0-9]*" "$d/boot.log" | head -1 || true)
      [ -n "$addr" ] && break
      sleep 1
    done
    [ -n "$addr" ] || { echo "$name: the bootstrap did not start" >&2; exit 1; }
    export P2PDILOCO_BOOTSTRAP=$addr
    p2pdiloco run create --name my-run --model gemma-tiny --inner-steps 50 "$@" >"$d/create.log" 2>&1
    p2pdiloco join --model gemma-tiny --no-tui >"$d/j0.log" 2>&1 &
    echo $! >>"$d/pids"
    p2pdiloco join --model gemma-tiny --no-tui --state-dir "$d/v1" --identity "$d/v1/key" \
      >"$d/j1.log" 2>&1 &
    echo $! >>"$d/pids"
  )
}

stop_runs() {
  for n in plain scored; do
    [ -f "$OUT/$n/pids" ] && xargs -r kill -INT <"$OUT/$n/pids" 2>/dev/null || true
  done
  sleep 60
  for n in plain scored; do
    [ -f "$OUT/$n/pids" ] && xargs -r kill -9 <"$OUT/$n/pids" 2>/dev/null || true
  done
}
trap stop_runs EXIT

start_run plain 31999 18080 --no-score-work
start_run scored 32099 18180
sleep $((MINUTES * 60))
stop_runs
trap - EXIT

rate() {  # the creator's node's applied versions: "N versions in S s (R/min)"
  grep "applied version" "$OUT/$1/j0.log" | awk '
    { split($2, t, /[:,]/); s = t[1] * 3600 + t[2] * 60 + t[3]; if (!n++) first = s; last = s }
    END { if (n < 2) { print 0, 0, 0; exit } d = last - first; printf "%d %d %.3f\n", n - 1, d, (n - 1) * 60 / d }'
}
read -r pv ps pr < <(rate plain)
read -r sv ss sr < <(rate scored)
echo "without scoring: $pv versions in $ps s after the first ($pr/min)"
echo "with work scoring (the default): $sv versions in $ss s after the first ($sr/min)"
awk -v a="$sr" -v b="$pr" 'BEGIN { if (b > 0) printf "ratio (scored / plain): %.2f\n", a / b }'

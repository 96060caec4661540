#!/usr/bin/env bash
# The README's walk on one machine, as a volunteer lives it: a bootstrap, `run create` with the
# README's flags, the creator's `join` and two more; after MINUTES the third is stopped with
# Ctrl-C, the bootstrap is stopped and restarted on its port, the run goes on for 3 minutes,
# `status` is read, the two left are stopped with Ctrl-C and `export` writes the model. Every
# step is printed with its time and exit code; logs stay in OUT_DIR (fresh HOME there).
#
#   bench/readme_walk.sh [MINUTES] [OUT_DIR] [run create flags...]   (defaults: 5, /tmp/readme_walk)
#
# Ports 31337 and 8080 (the README's) must be free.
set -u
MINUTES=${1:-5}
W=${2:-/tmp/readme_walk}
shift 2 2>/dev/null || shift $#
BIN=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin
rm -rf "$W" && mkdir -p "$W/h" "$W/v2" "$W/v3"
export HOME=$W/h PATH=$BIN:$PATH
cd "$W" || exit 1
ts() { date +%H:%M:%S; }
p2pdiloco bootstrap --port 31337 --http-port 8080 >boot.log 2>&1 &
BP=$!
A=
for _ in $(seq 120); do
  A=$(grep -o "/ip4/127.0.0.1/tcp/31337/p2p/[A-Za-z0-9]*" boot.log | head -1)
  [ -n "$A" ] && break
  sleep 1
done
[ -n "$A" ] || { echo "the bootstrap did not start (boot.log)"; kill -9 $BP; exit 1; }
export P2PDILOCO_BOOTSTRAP=$A
echo "$(ts) bootstrap $A"
p2pdiloco run create --name my-run --model gemma-tiny --inner-steps 50 "$@" >create.log 2>create.err
echo "$(ts) run create rc=$? (work scoring signed: $(grep -c '"z_min"' create.log))"
grep "^note:" create.err
p2pdiloco join --model gemma-tiny --no-tui >j1.log 2>&1 &
J1=$!
p2pdiloco join --model gemma-tiny --no-tui --state-dir "$W/v2" --identity "$W/v2/key" >j2.log 2>&1 &
J2=$!
p2pdiloco join --model gemma-tiny --no-tui --state-dir "$W/v3" --identity "$W/v3/key" >j3.log 2>&1 &
J3=$!
echo "$(ts) three volunteers joined"
sleep $((MINUTES * 60))
echo "$(ts) Ctrl-C on the third volunteer"
kill -INT $J3; wait $J3; echo "$(ts) it exited rc=$?: $(grep 'stopped cleanly' j3.log)"
sleep 20
echo "$(ts) Ctrl-C on the bootstrap"
kill -INT $BP; wait $BP; echo "$(ts) it exited rc=$?"
sleep 5
p2pdiloco bootstrap --port 31337 --http-port 8080 >boot2.log 2>&1 &
BP=$!
echo "$(ts) bootstrap restarted"
sleep 180
p2pdiloco status >status.log 2>&1; echo "$(ts) status rc=$?"; cat status.log
echo "$(ts) Ctrl-C on the two left"
kill -INT $J1 $J2
wait $J1; echo "$(ts) creator exited rc=$?: $(grep 'stopped cleanly' j1.log)"
wait $J2; echo "$(ts) second exited rc=$?: $(grep 'stopped cleanly' j2.log)"
kill -INT $BP; wait $BP; echo "$(ts) bootstrap exited rc=$?"
grep -h "chain verified" boot2.log | tail -1
for j in j1 j2 j3; do echo "$j: $(grep -o 'deltas [0-9]* accepted[^|]*' $j.log | tail -1)"; done
# Committee size and quorum of each certified version, from the creator's certificates
python - "$W/h" <<'PY'
import json, pathlib, sys
certs = sorted(pathlib.Path(sys.argv[1]).rglob("certs/*.json"))
seen = {}
for path in certs:
    body = json.loads(path.read_bytes())["body"]
    seen[body["version"]] = f"{len(body['committee'])}/{body['quorum']}v{body.get('view', 0)}"
print("committee size/quorum, view, by version:", " ".join(f"{v}:{c}" for v, c in sorted(seen.items())))
PY
echo "work scores (creator's node): $(grep -c 'work score' j1.log), above 3: $(grep 'work score' j1.log | sed -E 's/.*: ([-+0-9.]+) standard.*/\1/' | awk '$1 > 3' | wc -l)"
p2pdiloco export --run my-run --out "$W/model" >export.log 2>&1; echo "$(ts) export rc=$?"
tail -3 export.log

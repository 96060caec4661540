#!/bin/bash
# the rest, one process at a time, after m2-dp (pid 6095); cut to fit the session
cd /work/wt/parity && export PYTHONPATH=$PWD
P="nice -n 10 /work/main/.venv/bin/python bench/parity.py"
while kill -0 6095 2>/dev/null; do sleep 5; done
echo "$(date -u +%T) end m2-dp" >> parity-runs/queue.log
run() { out=$1; shift; echo "$(date -u +%T) start $out" >> parity-runs/queue.log; $P "$@" --out parity-runs/$out.json > parity-runs/$out.log 2>&1; echo "$(date -u +%T) end $out rc $?" >> parity-runs/queue.log; }
run m2-dl --learners 2 --methods diloco --lrs 8e-4 --extend 0 --outer 0.5:0.5
run m1-o0305 --learners 1 --methods diloco --lrs 8e-4 --extend 0 --base-outer 0.3:0.5 --outer
run m8-dp16 --learners 8 --methods data-parallel --lrs 1.6e-3 --extend 0
run m8-dl8 --learners 8 --methods diloco --lrs 8e-4 --extend 0 --outer
run m2-dl16 --learners 2 --methods diloco --lrs 1.6e-3 --extend 0 --outer
run m8-dp32 --learners 8 --methods data-parallel --lrs 3.2e-3 --extend 0
run m8-dl16 --learners 8 --methods diloco --lrs 1.6e-3 --extend 0 --outer
run m4-o0505 --learners 4 --methods diloco --lrs 8e-4 --extend 0 --base-outer 0.5:0.5 --outer
echo "$(date -u +%T) all done" >> parity-runs/queue.log

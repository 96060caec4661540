#!/bin/bash
# the cells after the sparse ones, one process at a time (issue 40 item 1)
cd /work/wt/parity && export PYTHONPATH=$PWD
P="nice -n 10 /work/main/.venv/bin/python bench/parity.py"
while ! grep -q done parity-runs/m4-sparse.log; do sleep 5; done
run() { out=$1; shift; echo "$(date -u +%T) start $out" >> parity-runs/queue.log; $P "$@" --out parity-runs/$out.json > parity-runs/$out.log 2>&1; echo "$(date -u +%T) end $out rc $?" >> parity-runs/queue.log; }
run m1-dl4 --learners 1 --methods diloco --lrs 4e-4 --extend 0 --outer
run m1-o0505 --learners 1 --methods diloco --lrs 8e-4 --extend 0 --base-outer 0.5:0.5 --outer
run m2-dp --learners 2 --methods data-parallel
run m2-dl --learners 2 --methods diloco --lrs 8e-4 1.6e-3 --extend 1 --outer 0.5:0.5
run m8-dp --learners 8 --methods data-parallel --lrs 1.6e-3 3.2e-3 --extend 0
run m8-dl --learners 8 --methods diloco --lrs 8e-4 1.6e-3 --extend 0 --outer
echo "$(date -u +%T) all done" >> parity-runs/queue.log

#!/bin/bash
# after m8-dl16 (pid 15562): M = 4 outer 0.5/0.5, bracket M = 8 data-parallel below, M = 8 outer 0.5/0.5 at its best DiLoCo inner lr
cd /work/wt/parity && export PYTHONPATH=$PWD
P="nice -n 10 /work/main/.venv/bin/python bench/parity.py"
while kill -0 15562 2>/dev/null; do sleep 5; done
run() { out=$1; shift; echo "$(date -u +%T) start $out" >> parity-runs/queue.log; $P "$@" --out parity-runs/$out.json > parity-runs/$out.log 2>&1; echo "$(date -u +%T) end $out rc $?" >> parity-runs/queue.log; }
run m4-o0505 --learners 4 --methods diloco --lrs 8e-4 --extend 0 --base-outer 0.5:0.5 --outer
run m8-dp8 --learners 8 --methods data-parallel --lrs 8e-4 --extend 0
best=$(python3 -c "
import json,glob
c=[v for f in glob.glob('parity-runs/m8-dl*.json') for v in json.load(open(f))['cells'].values()]
print(min(c,key=lambda v:v['select_loss'])['inner_lr'])")
run m8-o0505 --learners 8 --methods diloco --lrs $best --extend 0 --base-outer 0.5:0.5 --outer
echo "$(date -u +%T) queue4 done" >> parity-runs/queue.log

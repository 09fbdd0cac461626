#!/bin/bash
cd /work/study
PY=/work/main/.venv/bin/python
export OMP_NUM_THREADS=1
R="$PY -m minimoe.experiments run --routers all,ssr_p0,softmax_topk_dropless,baselines --scale reference --workers 2 --threads 1 --no-progress --out minimoe/experiments/results/reference-cpu"
FRESH=${FRESH:-}
$R --task all --seeds 8 $FRESH && $R --task clustered --seeds 24
echo "STUDY EXIT $?"

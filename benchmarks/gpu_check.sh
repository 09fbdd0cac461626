#!/usr/bin/env bash
# The GPU checks of issue 19 ("Ready for a GPU") in one command, for a machine with CUDA and a
# Python that has torch, pytest and hypothesis (no install: such a machine may reach no package index).
#
#   bash benchmarks/gpu_check.sh [BUDGET_S]      # default 480 s for the whole script
#
# 1. the device and torch it ran on;
# 2. tests/test_host_sync.py: under CUDA every sync-free router's training forward runs with
#    torch.cuda.set_sync_debug_mode("error") (book: appendix "Performance", "No host synchronisation");
# 3. python -m benchmarks --device cuda --quick, one section at a time, those that run on the GPU:
#    routing from logits, the layer's paths (with the dispatch's tokens/s against the memory-bandwidth
#    bound), dropless routing and router overhead. The other sections time CPU solvers (BASE's
#    assignment, the k-subset DP, Gumbel matching) or need POT; `python -m benchmarks` runs them.
#
# Each step has its share of the budget and a timeout, so the script ends inside it even when a step
# hangs, and a failed step does not stop the next. Everything goes into one archive,
# $OUT/gpu-check.tar.gz ($OUT defaults to /tmp/minimoe-gpu-check), and the end of each log is printed.
# GPU_CHECK_DEVICE=cpu runs the same steps on the CPU (a dry run of the script itself).
set -uo pipefail
budget=${1:-480}
if ! [[ $budget =~ ^[0-9]+$ ]] || [ "$budget" -lt 120 ]; then
    echo "usage: bash benchmarks/gpu_check.sh [BUDGET_S], a whole number of seconds >= 120; got '$budget'" >&2
    exit 2
fi
device=${GPU_CHECK_DEVICE:-cuda}
python=${PYTHON:-python3}
out=${OUT:-/tmp/minimoe-gpu-check}
sections=(softmax_topk_routing layer_paths dropless_layer router_overhead)  # the longest last: it gets what is left
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
logs=$(mktemp -d)
start=$SECONDS
left() { echo $((budget - (SECONDS - start) - 15)); }  # 15 s kept for the archive

{
    date -u
    command -v nvidia-smi > /dev/null && timeout 30 nvidia-smi -L
    timeout -k 5 60 "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
                  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")'
    # which code ran: the commit where the checkout has its history, a digest of the sources anyway
    git log -1 --format='minimoe %H %s' 2> /dev/null
    cat minimoe/*.py minimoe/*/*.py benchmarks/*.py tests/test_host_sync.py | sha1sum | sed 's/^/sources sha1 /'
} > "$logs/device.txt" 2>&1

limit=$(($(left) / 4))
[ "$limit" -lt 30 ] && limit=30
timeout -k 10 "$limit" "$python" -m pytest -q -p no:cacheprovider tests/test_host_sync.py \
    > "$logs/host_sync.txt" 2>&1
echo "exit status $? (time limit $limit s)" >> "$logs/host_sync.txt"

for i in "${!sections[@]}"; do
    section=${sections[$i]}
    share=$(($(left) / (${#sections[@]} - i)))  # what is left, shared by the sections still to run
    if [ "$share" -lt 20 ]; then
        echo "not run: the budget of $budget s was spent" > "$logs/$section.txt"
        continue
    fi
    touch "$logs/.started"
    timeout -k 10 "$share" "$python" -m benchmarks --device "$device" --quick --only "$section" \
        > "$logs/$section.txt" 2>&1
    echo "exit status $? (time limit $share s)" >> "$logs/$section.txt"
    # this run's file only: a section cut short writes none, and an older one may lie there
    find benchmarks/results -name "*-$device-quick-$section.json" -newer "$logs/.started" \
        -exec cp {} "$logs/$section.json" \;
done

rm -f "$logs/.started"
mkdir -p "$out"
tar czf "$out/gpu-check.tar.gz" -C "$logs" .
for log in "$logs"/*.txt; do
    echo "== $(basename "$log")"
    tail -n 25 "$log"
done
echo "archive: $out/gpu-check.tar.gz ($((SECONDS - start)) s)"

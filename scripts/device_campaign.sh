#!/usr/bin/env bash
# One GPU lease, one call: install the wheels carried in .whl, run campaign reproduce.py commands on CUDA until a
# deadline, and pack the finished runs' records (no weights) for scripts/campaign.sh to collect here.
#
#   DEADLINE_S=500 bash scripts/device_campaign.sh "<reproduce.py args>" ["<reproduce.py args>" ...]
#
# Each argument is one reproduce.py command (finished runs are skipped, so a second lease goes on where the first
# stopped). A run still training at the deadline is killed and left out; the one-shot runs have nothing to resume.
# Output: $OUT/runs.tar.gz (outputs/runs/<id>/ without *.pt) and $OUT/device.log. Data: FEDBENCH_DATA_MIRROR
# (default .devdata, a copy of ../shared/datasets/<NAME> carried with the call).
#
# Session 61's lease (FedLPA Table 8 MNIST, results/README.md), prepared here before the machine starts:
#   .whl: `pip download --no-deps --only-binary=:all: --python-version 3.12 ...` of hydra-core, omegaconf, submitit,
#         hydra-submitit-launcher, hydra-joblib-launcher, curvlinops-for-pytorch, backpack-for-pytorch, einconv,
#         unfoldNd, and `pip wheel --no-deps antlr4-python3-runtime==4.9.3` (no wheel on PyPI); the rest is on the image
#   .devdata/MNIST: `cp -r ../shared/datasets/MNIST .devdata/`; both in .git/info/exclude, named in the call's carry
#   the tree that travels must stay under 64 MiB: results/records alone is about 130, so it was left out of the index
#   for the call (`git rm -r -q --cached results/records` with /results/records/ in .git/info/exclude, then
#   `git reset -q -- results/records`); the runs skipped as done are then those of the lease itself
set -u
start=$(date +%s)
deadline=${DEADLINE_S:-500}
out=${OUT:-/tmp/out}
mkdir -p "$out"
log="$out/device.log"
PY=${PYTHON:-python3}
if [ -d .whl ] && [ -z "${NO_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed" | tee -a "$log"; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD"
fi
export FEDBENCH_DATA_MIRROR=${FEDBENCH_DATA_MIRROR:-$PWD/.devdata} FEDBENCH_OUTPUTS=$PWD/outputs PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$log" 2>&1
for cmd in "$@"; do
    left=$(( deadline - ($(date +%s) - start) ))
    [ "$left" -le 30 ] && { echo "deadline: skipped $cmd" >> "$log"; continue; }
    echo "=== $(date +%T) (${left}s left) $cmd" >> "$log"
    # shellcheck disable=SC2086
    set -f   # the Hydra overrides hold [ ] that must not glob
    timeout --signal=INT --kill-after=10 "$left" $PY scripts/reproduce.py $cmd ${DEVICE_HW:-hardware=cuda} >> "$log" 2>&1
    rc=$?
    set +f
    echo "=== rc=$rc $(date +%T)" >> "$log"
    # fail fast: a first command with no finished run is a setup error; hand the lease back early to fix it
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && ! grep -lqsE '^  "status": "ok"' outputs/runs/*/metrics.json; then
        echo "first command failed before any run finished: stopping" | tee -a "$log"; tail -n 60 "$log"; exit 1
    fi
done
# finished runs only: an interrupted run writes its record too, with "status": "failed"
finished=$(cd outputs/runs 2>/dev/null && for d in */; do
    grep -qE '^  "status": "ok"' "$d/metrics.json" 2>/dev/null && echo "${d%/}"; done)
echo "finished runs: $(echo "$finished" | grep -c .)" | tee -a "$log"
[ -n "$finished" ] && (cd outputs/runs && tar --exclude='*.pt' -czf "$out/runs.tar.gz" $finished)
tail -n 40 "$log"

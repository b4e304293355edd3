#!/usr/bin/env bash
# A one-shot baseline (Fisher Merge by default) with FedBEns's released code, side by side with fedbench on the same
# split (results/gaps.md#fedbens-table1). The released repository is run unchanged, never copied: fetch it
# (github.com/jacopot96/FedBEns, commit b2c9813), unpack its One_shot_FL folder, then
#
#   bash scripts/gaps/fedbens_released_baseline.sh <One_shot_FL folder> <seed> <alpha> [alg=fisher_merge] [epochs=20] [clients=5]
#   bash scripts/gaps/fedbens_released_baseline.sh /work/released_bens/One_shot_FL 0 0.4
#   bash scripts/gaps/fedbens_released_baseline.sh /work/released_bens/One_shot_FL 0 0.3 otfusion 20 10   # Table 2, C = 10
#
# The flags are those of the released README (main_baselines.py, LeNet, 5 clients, 20 local epochs); Table 2 changes
# the number of clients (10, 20, 40). The released
# code needs nngeometry 0.3 and laplace-torch 0.2.2.2 (with curvlinops 2.0.1, asdfghjkl 0.1a4, POT, kornia); put
# them in a folder of their own and name it in RELEASED_PYTHONPATH, so fedbench's environment is left as it is:
#   pip install --no-deps --target <dir> nngeometry==0.3 laplace-torch==0.2.2.2 curvlinops-for-pytorch==2.0.1 \
#       asdfghjkl==0.1a4 POT==0.9.5 kornia==0.7.4 kornia_rs==0.1.7 torchmetrics lightning-utilities
# The released code asks for 'cuda' everywhere; the wrapper maps that device to the CPU (one thread) and changes
# nothing else. Fashion-MNIST comes from the offline copy (FEDBENCH_DATA_ROOT or ../shared/datasets), decompressed
# where torchvision looks for it. It prints the released split's label counts per client and the test accuracy.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 <One_shot_FL folder> <seed> <alpha> [alg=fisher_merge] [epochs=20] [clients=5]" >&2; exit 2; }
[ -d "$1" ] || { echo "error: no such folder: $1" >&2; exit 2; }
REL=$(cd "$1" && pwd); SEED=$2; ALPHA=$3; ALG=${4:-fisher_merge}; EPOCHS=${5:-20}; CLIENTS=${6:-5}
HERE=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-$HERE/.venv/bin/python}
SRC=${FEDBENCH_DATA_ROOT:-$HERE/../shared/datasets}/FashionMNIST/raw
[[ "$SEED" =~ ^[0-9]+$ && "$EPOCHS" =~ ^[0-9]+$ && "$CLIENTS" =~ ^[1-9][0-9]*$ ]] || { echo "error: seed, epochs and clients must be whole numbers (got '$SEED' '$EPOCHS' '$CLIENTS')" >&2; exit 2; }
[[ "$ALPHA" =~ ^[0-9]*\.?[0-9]+$ ]] || { echo "error: alpha must be a positive number (got '$ALPHA')" >&2; exit 2; }
[ -f "$REL/main_baselines.py" ] || { echo "error: $REL has no main_baselines.py (not FedBEns's One_shot_FL folder)" >&2; exit 2; }
[ -d "$SRC" ] || { echo "error: no Fashion-MNIST copy at $SRC (set FEDBENCH_DATA_ROOT)" >&2; exit 2; }
[ -n "${RELEASED_PYTHONPATH:-}" ] || { echo "error: set RELEASED_PYTHONPATH to the folder holding nngeometry 0.3 and laplace-torch 0.2.2.2" >&2; exit 2; }
mkdir -p "$REL/data/fashionmnist/FashionMNIST/raw" "$REL/results"
for f in "$SRC"/*.gz; do
    out="$REL/data/fashionmnist/FashionMNIST/raw/$(basename "$f" .gz)"
    [ -f "$out" ] || gunzip -c "$f" > "$out"
done
cd "$REL"
out="run_${ALG}_a${ALPHA}_s${SEED}_e${EPOCHS}$([ "$CLIENTS" = 5 ] || echo "_c$CLIENTS").out"
OMP_NUM_THREADS=1 PYTHONPATH="$RELEASED_PYTHONPATH" "$PY" -c "
import runpy, sys, torch
torch.set_num_threads(1)
def cpu(a):
    cuda = (isinstance(a, str) and a.startswith('cuda')) or (isinstance(a, torch.device) and a.type == 'cuda')
    return 'cpu' if cuda else a
def on_cpu(method):
    def moved(self, *args, **kw):
        if 'device' in kw: kw['device'] = cpu(kw['device'])
        return method(self, *[cpu(a) for a in args], **kw)
    return moved
torch.Tensor.to = on_cpu(torch.Tensor.to); torch.nn.Module.to = on_cpu(torch.nn.Module.to)
torch.Tensor.cuda = lambda self, *a, **k: self; torch.nn.Module.cuda = lambda self, *a, **k: self
sys.argv = sys.argv[1:]
runpy.run_path('main_baselines.py', run_name='__main__')" main_baselines.py --dataset FashionMNIST --model LeNet \
    --num_clients "$CLIENTS" --local_epochs "$EPOCHS" --alpha="$ALPHA" --seed "$SEED" --algs_to_run "$ALG" > "$out" 2>&1 \
    || { echo "error: the released run failed: $(tail -1 "$out") (full output: $REL/$out)" >&2; exit 1; }
grep -h "Data statistics" "$out" | sed 's/np\.int64(\([0-9]*\))/\1/g' | cut -c1-600
grep -h "^Local Model .* Test Acc" "$out" | sed 's/tensor(\[*\([0-9.]*\)\]*)/\1/g'
grep -h "^Test Acc" "$out" | tail -1

#!/usr/bin/env bash
# One-shot FedAvg (or FedNova, SCAFFOLD, or FedLPA itself: alg 'our') with FedLPA's released code, side by side with
# fedbench on the same split
# (results/gaps.md, FedLPA Table 6 "Baselines"). The released repository is run unchanged, never copied: fetch it
# (github.com/lebronlambert/FedLPA_NeurIPS2024, commit 08dd729), then
#
#   bash scripts/gaps/fedlpa_released_baseline.sh <released checkout> <seed> <partition> [alg] [epochs] [train seed]
#   bash scripts/gaps/fedlpa_released_baseline.sh /work/released_lpa 0 'noniid-labeldir --beta=0.5'
#   bash scripts/gaps/fedlpa_released_baseline.sh /work/released_lpa 1 'noniid-#label2'
#   DATASET=mnist bash scripts/gaps/fedlpa_released_baseline.sh /work/released_lpa 1 'noniid-labeldir --beta=0.05' our 20
#
# The flags are those of the released scripts/experiments.sh (lr 0.01, momentum 0.9, batch 64, 10 parties, 1 round;
# PARTIES=5 for FedLPA's Table 9),
# on the CPU with one thread; alg 'our' runs experiments_our.py (FedLPA, --coor=0.999 as the scripts), whose logged
# accuracy is max(GD, EA) on the test set. DATASET=fmnist (default) or mnist comes from the offline copy (for MNIST the
# wrapper repairs the released loader's dispatch, which sends mnist to its synthetic-data class; see below)
# (FEDBENCH_DATA_ROOT or ../shared/datasets),
# decompressed under <checkout>/data, since torchvision looks for the raw files there and would try to download them.
# It prints the released log's label counts per client (to check the split against fedbench's record) and the
# global model's test accuracy.
# The released script draws the split and the training from one seed (--init_seed). A sixth argument, the training
# seed, keeps the split of <seed> and reseeds torch, numpy and random right after the split is drawn (the wrapper
# wraps utils.partition_data; the released files are unchanged), to measure the released code's training spread on
# one split.
# DUMP=<file.pt> (alg 'our' only) saves the released clients' weights, their damped K-FAC factors, the weights p_k and
# the logged GD / EA test accuracies, for fedbench's server on the same clients: scripts/gaps/fedlpa_cross_server.py.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 <released checkout> <seed> <partition flags> [alg=fedavg] [epochs=20] [train seed]" >&2; exit 2; }
[ -d "$1" ] || { echo "error: no such folder: $1" >&2; exit 2; }
REL=$(cd "$1" && pwd); SEED=$2; PART=$3; ALG=${4:-fedavg}; EPOCHS=${5:-20}; TRAIN_SEED=${6:-}
[[ "$SEED$TRAIN_SEED" =~ ^[0-9]+$ && "$EPOCHS" =~ ^[0-9]+$ ]] || { echo "error: seeds and epochs must be whole numbers (got '$SEED' '$TRAIN_SEED' '$EPOCHS')" >&2; exit 2; }
PARTIES=${PARTIES:-10}
[[ "$PARTIES" =~ ^[1-9][0-9]*$ ]] || { echo "error: PARTIES must be a positive whole number (got '$PARTIES')" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-$HERE/.venv/bin/python}
DATASET=${DATASET:-fmnist}
DUMP=${DUMP:-}
[ -z "$DUMP" ] || { [ "$ALG" = our ] || { echo "error: DUMP needs alg 'our' (FedLPA)" >&2; exit 2; }; DUMP=$(cd "$(dirname "$DUMP")" && pwd)/$(basename "$DUMP"); }
case $DATASET in fmnist) DIR=FashionMNIST ;; mnist) DIR=MNIST ;;
    *) echo "error: DATASET must be fmnist or mnist (got '$DATASET')" >&2; exit 2 ;; esac
SCRIPT=experiments.py; EXTRA=""
[ "$ALG" = our ] && { SCRIPT=experiments_our.py; EXTRA=--coor=0.999; }
SRC=${FEDBENCH_DATA_ROOT:-$HERE/../shared/datasets}/$DIR/raw
[ -f "$REL/experiments.py" ] || { echo "error: $REL has no experiments.py (not FedLPA's released code)" >&2; exit 2; }
[ -f "$REL/$SCRIPT" ] || { echo "error: $REL has no $SCRIPT (alg '$ALG' runs it)" >&2; exit 2; }
[ -d "$SRC" ] || { echo "error: no $DIR copy at $SRC (set FEDBENCH_DATA_ROOT)" >&2; exit 2; }
mkdir -p "$REL/data/$DIR/raw" "$REL/logs" "$REL/models"
for f in "$SRC"/*.gz; do
    out="$REL/data/$DIR/raw/$(basename "$f" .gz)"
    [ -f "$out" ] || gunzip -c "$f" > "$out"
done
cd "$REL"
before=$(ls logs | wc -l)
# shellcheck disable=SC2086
OMP_NUM_THREADS=1 TRAIN_SEED="$TRAIN_SEED" DATASET="$DATASET" DUMP="$DUMP" "$PY" -c "
import os, random, runpy, sys, numpy, torch
torch.set_num_threads(1)
if os.environ['TRAIN_SEED']:
    sys.path.insert(0, '.')
    import utils
    drawn = utils.partition_data
    def split_then_reseed(*args, **kw):
        out = drawn(*args, **kw)
        s = int(os.environ['TRAIN_SEED']); numpy.random.seed(s); torch.manual_seed(s); random.seed(s)
        return out
    utils.partition_data = split_then_reseed
if os.environ['DATASET'] == 'mnist':
    # released utils.get_dataloader: after its 'mnist' branch, an 'if emnist ... else' chain sends mnist to the
    # Generated loader (data/generated/*.npy) with no transform; give that branch MNIST with ToTensor, the branch's
    # own transform at --noise=0 (the released files are unchanged)
    sys.path.insert(0, '.')
    import utils, torchvision.transforms as T
    def mnist(datadir, dataidxs=None, train=True, transform=None, download=False, **kw):
        return utils.MNIST_truncated(datadir, dataidxs=dataidxs, train=train, transform=T.ToTensor(), download=download)
    utils.Generated = mnist
if os.environ['DUMP']:
    # FedLPA ('our') only: after the server step, save the clients' weights, their damped factors, the weights p_k,
    # the global model and the logged GD / EA test accuracies for scripts/gaps/fedlpa_cross_server.py. The released
    # loop calls compute_accuracy on test_dl_global twice once newtons_param exists (GD model, then EA model).
    sys.path.insert(0, '.')
    import copy, utils
    measured, logged = utils.compute_accuracy, []
    def compute_and_dump(model, dataloader, *a, **kw):
        out = measured(model, dataloader, *a, **kw)
        g = sys._getframe(1).f_globals
        if 'newtons_param' in g and dataloader is g.get('test_dl_global'):
            logged.append(float(out[0] if isinstance(out, tuple) else out))
            if len(logged) == 2:
                sel = [int(i) for i in g['selected']]
                torch.save({'clients': [g['nets'][i].state_dict() for i in sel],
                            'factors': [{n: (f[0], f[1]) for n, f in g['f_nets'][i].items()} for i in sel],
                            'p': [float(x) for x in g['fed_avg_freqs']], 'model': copy.deepcopy(g['global_model']),
                            'released_gd': logged[0], 'released_ea': logged[1], 'args': vars(g['args'])},
                           os.environ['DUMP'])
        return out
    utils.compute_accuracy = compute_and_dump
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')" $SCRIPT --model=simple-cnn --dataset=$DATASET \
    --alg="$ALG" --lr=0.01 --batch-size=64 --epochs="$EPOCHS" --n_parties="$PARTIES" --rho=0.9 --comm_round=1 \
    --partition=$PART --device=cpu --datadir=./data/ --logdir=./logs/ --noise=0 --init_seed="$SEED" $EXTRA > run.out 2>&1 \
    || { echo "error: the released run failed: $(tail -1 run.out) (full output: $REL/run.out)" >&2; exit 1; }
[ "$(ls logs | wc -l)" -gt "$before" ] || { echo "error: the released run wrote no log" >&2; exit 1; }
log=$(ls -t logs/*experiment_log-*.log | head -1)
grep -h "Data statistics" "$log" | sed 's/np\.int64(\([0-9]*\))/\1/g' | cut -c1-400
grep -h "Global Model Test accuracy" "$log" | tail -1

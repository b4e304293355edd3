#!/usr/bin/env bash
# The reproduction campaign's long runs: the commands behind the committed records (results/records/), step by step in
# the order of results/campaign.yaml. Resumable: a run whose complete, current record is in outputs/ or
# results/records/ is skipped, so on a fresh machine a step trains only what is missing.
#
#   bash scripts/campaign.sh --list                                   # the steps, in order, with what they run
#   nohup bash scripts/campaign.sh fedbens_table1_fmnist >> campaign.log 2>&1 &     # one step (or several); at
#                                                                     # its end, its tables as with --collect
#   bash scripts/campaign.sh --status fedbens_table1_fmnist           # runs done / to do per command (trains nothing)
#   bash scripts/campaign.sh --collect fedbens_table1_fmnist          # publish its finished records, write its tables
#   make tables                                                       # then every table and the scoreboard
#   bash scripts/campaign.sh --park                                   # before a session ends: unfinished runs'
#                                                                     # checkpoints to results/checkpoints/ (commit);
#                                                                     # a fresh machine's run goes on from them
#
# Each run uses one thread and one job at a time (two steps side by side fill a 2-core machine); CAMPAIGN_HW replaces
# those hardware overrides (e.g. CAMPAIGN_HW="hardware=cuda"). PYTHON defaults to .venv/bin/python.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# NHWC convolutions train LeNet 1.19x faster here (float rounding differs; hardware is not part of a run's id, as a GPU
# run is the same run as a CPU one; the record's config keeps the setting). Records before session 11 ran contiguous.
HW=${CAMPAIGN_HW:-hardware=cpu hardware.num_threads=1 hardware.jobs=1 hardware.memory_format=channels_last progress=false}
COLLECT=""
STATUS=""

run() {
    [ -n "$COLLECT" ] && return   # --collect: only the step's table lines
    if [ -n "$STATUS" ]; then     # --status: what is done and still to do, nothing trained
        echo "$* :: $($PY scripts/reproduce.py --dry-run "$@" 2>&1 | tail -1)"
        return
    fi
    echo "=== $(date +%T) $*"
    # shellcheck disable=SC2086
    $PY scripts/reproduce.py "$@" $HW
    echo "=== rc=$? $(date +%T)"
}

table() {   # a step's tables (the collect calls in results/collections.yaml): publish its finished records into
            # results/records/ and write the tables
    [ -z "$COLLECT" ] && return
    local key="$*"
    [ -n "${COLLECTED[$key]:-}" ] && return   # several steps feed one table: collect it once
    COLLECTED[$key]=1
    $PY scripts/reproduce.py --collect-only "$@"
}
declare -A COLLECTED

# Aggregator lists that leave out what cannot run here: DENSE at the papers' 200 synthesis epochs needs a GPU
# (results/campaign.yaml); FedLap-Func's 5000 server steps a round are left out of the 5-epoch raw-pixel reading
# (WITHFUNC: the 1-epoch reading, which the scoreboard's verdicts check every Table 1-3 method against, has it).
FEDFISHER='aggregators=[fedavg,fedfisher_diag,fedfisher_kfac,fisher_merge,regmean,{name:otfusion,align_last_layer:true},pfnm]'
FEDLPA='aggregators=[fedlpa,fedavg,fednova,scaffold,{name:fedprox,mu:0.001},{name:fedprox,mu:0.01},{name:fedprox,mu:0.1},{name:fedprox,mu:1.0}]'
FEDLPA_CG='aggregators=[fedlpa,{name:fedlpa,solver:cg},fedavg,fednova,scaffold,{name:fedprox,mu:0.001},{name:fedprox,mu:0.01},{name:fedprox,mu:0.1},{name:fedprox,mu:1.0}]'
FEDLPA_CG_ONESTAGE='aggregators=[fedlpa,{name:fedlpa,solver:cg},fedavg,fednova,scaffold]'   # no FedProx: one client stage
FEDBENS='aggregators=[fedbens,fedbens_diag_full,fedfisher_kfac,regmean,{name:otfusion,align_last_layer:true},fisher_merge]'
NOFUNC='aggregators=[fedavg,{name:fedprox,mu:${hp.prox},scale:sum},{name:feddyn,alpha:${hp.dyn_alpha},weight_decay:${hp.dyn_wd}},{name:fedlap,delta:${hp.delta},rho:${hp.rho}},{name:fedlap_cov,delta:${hp.delta}}]'
WITHFUNC="${NOFUNC%]},{name:fedlap_func,delta:\${hp.delta},rho:\${hp.rho},tau:\${hp.tau},server_iters:\${hp.server_iters},server_lr:\${hp.server_lr}}]"
RAW='dataset.normalize={mean:[0.0],std:[0.00392156862745098]}'   # gaps.md#fedlap-table1: inputs in [0, 255]
LPA_PARTITIONS=('beta=0.01' 'beta=0.05' 'beta=0.1' 'beta=0.3' 'beta=0.5' 'beta=1.0' '#C=1' '#C=2' '#C=3')

step_fedlap_table1_tabular() {   # UCI Credit, FLamby-Heart (fixed picks, then tuned on App. E's grids); Table 4
    run experiment=fedlap/table1 profile=paper dataset=uci_credit
    run experiment=fedlap/table1 profile=paper dataset=flamby_heart
    run experiment=fedlap/table1 profile=paper tuning=on dataset=flamby_heart
    run experiment=fedlap/table4 profile=paper
    table experiment=fedlap/table1 profile=paper
    table experiment=fedlap/table1 profile=paper tuning=on dataset=flamby_heart
    table experiment=fedlap/table4 profile=paper
}
step_fedlap_table1_heart_standardize() {   # gaps.md#fedlap-table1-heart: FLamby's per-hospital training sets with its
                                           # pooled test set, everything with the pooled train statistics, and the raw
                                           # features of older FLamby, instead of per-hospital standardisation throughout
    for reading in pooledtest:center_train_pooled_test pooled:pooled none:none; do
        local name=heart${reading%%:*} mode=${reading#*:}
        run --name $name experiment=fedlap/table1 profile=paper dataset=flamby_heart dataset.kwargs.standardize=$mode
        table --name $name experiment=fedlap/table1 profile=paper dataset=flamby_heart dataset.kwargs.standardize=$mode
    done
}
step_fedlap_credit_fold4() {   # gaps.md#fedlap-table1-fold: PVI's 5-fold KFold test fold 4 (the last 130 shuffled rows), the
                               # fold whose centralised MAP test NLL matches App. D.2's (scripts/gaps/credit_folds.py),
                               # crossed with the local budget: 1 epoch (gaps.md#fedlap-table1's slower lead, outside
                               # App. E's UCI grid [5, 10, 20]) and 5 epochs (the grid's lowest) on the preset's fold 0
    local reading name fold epochs
    for reading in creditfold4:4: creditfold4e1:4:1 creditfold0e1::1 creditfold0e5::5; do
        IFS=: read -r name fold epochs <<< "$reading"
        local ovs=(${fold:+dataset.kwargs.test_fold=$fold} ${epochs:+"local.epochs=choice($epochs)"})
        run --name $name experiment=fedlap/table1 profile=paper dataset=uci_credit "${ovs[@]}"
        run --name $name experiment=fedlap/table4 profile=paper "${ovs[@]}"
        table --name $name experiment=fedlap/table1 profile=paper dataset=uci_credit "${ovs[@]}"
        table --name $name experiment=fedlap/table4 profile=paper "${ovs[@]}"
    done
}
step_fedlap_table1_fmnist() {    # FMNIST 10 %, 10 clients, both splits (Tables 2, 3, 5 read these runs)
    run experiment=fedlap/table1 profile=paper dataset=fmnist partition=homo,size_class_dirichlet num_clients=10
    table experiment=fedlap/table1 profile=paper
    table experiment=fedlap/table2 profile=paper
    table experiment=fedlap/table3 profile=paper
    table experiment=fedlap/table5 profile=paper
}
step_fedlap_table1_fmnist100() {  # Table 1's FMNIST row with 100 clients (all of FMNIST, size-then-class Dirichlet, 50 rounds;
                                  # about 2 CPU h a seed, FedLap-Func's 5000 server steps a round the largest part)
    run experiment=fedlap/table1 profile=paper dataset=fmnist partition=size_class_dirichlet num_clients=100
    table experiment=fedlap/table1 profile=paper
    table experiment=fedlap/table2 profile=paper
    table experiment=fedlap/table3 profile=paper
    table experiment=fedlap/table5 profile=paper
}
step_fedlap_appE5() {             # App. E.5's in-text table: FedLap-Func with 2 memory points per class (FMNIST 10 %, 3 seeds),
                                  # then the raw-pixel, 1-local-epoch reading that Table 1's FMNIST verdicts use
                                  # (gaps.md#fedlap-appE5; about 17 CPU min a run, the 5000 server steps a round)
    local e1=(--name rawpixels_e1 experiment=fedlap/appE5 profile=paper "$RAW" "local.epochs=choice(1)")
    run experiment=fedlap/appE5 profile=paper
    run "${e1[@]}"
    table experiment=fedlap/appE5 profile=paper
    table "${e1[@]}"
}
step_fedlap_table1_fmnist_rawpixels() {   # gaps.md#fedlap-table1 and #fedlap-table3: raw pixels, then 1 local epoch
    run --name rawpixels experiment=fedlap/table1 profile=paper dataset=fmnist partition=homo,size_class_dirichlet \
        num_clients=10 "$NOFUNC" "$RAW"
    # the 1-epoch reading: every FMNIST row of the preset, the 10-client rows of both splits, then the
    # 100-client heterogeneous row (FedLap-Func's 5000 server steps a round the largest part of it)
    local e1=(profile=paper dataset=fmnist "$WITHFUNC" "$RAW" "local.epochs=choice(1)")   # the scoreboard's reading
    run --name rawpixels_e1 experiment=fedlap/table1 "${e1[@]}"
    local fm=(profile=paper dataset=fmnist partition=homo,size_class_dirichlet num_clients=10 "$NOFUNC" "$RAW")
    table --name rawpixels experiment=fedlap/table1 "${fm[@]}"
    table --name rawpixels experiment=fedlap/table3 "${fm[@]}"
    table --name rawpixels_e1 experiment=fedlap/table1 "${e1[@]}"
    table --name rawpixels_e1 experiment=fedlap/table3 "${e1[@]}"
    table --name rawpixels_e1 experiment=fedlap/table2 "${e1[@]}"
    table --name rawpixels_e1 experiment=fedlap/table5 "${e1[@]}"   # final NLL of the slower-learning reading
}
step_fedlap_table1_mnist() {     # MNIST homogeneous (20 rounds) and heterogeneous (50 rounds)
    run experiment=fedlap/table1 profile=paper dataset=mnist partition=homo
    run experiment=fedlap/table1 profile=paper dataset=mnist partition=size_class_dirichlet
    table experiment=fedlap/table1 profile=paper
    table experiment=fedlap/table2 profile=paper
    table experiment=fedlap/table3 profile=paper
    table experiment=fedlap/table5 profile=paper
}
step_fedlap_table3_mnist_homog() {   # Table 3's own 50-round MNIST homogeneous runs (Table 1's row has 20 rounds)
    run experiment=fedlap/table3 profile=paper dataset=mnist partition=homo
    table experiment=fedlap/table3 profile=paper
}
step_fedlap_table3_feddyn_client_average() {   # gaps.md#fedlap-table3-feddyn: FedDyn's plain client average, the model the
                                              # official FedDyn code reports, instead of the server model it sends
    local dyn='aggregators=[{name:feddyn,alpha:${hp.dyn_alpha},weight_decay:${hp.dyn_wd},evaluate:client_average}]'
    run --name dyncavg experiment=fedlap/table3 profile=paper dataset=mnist partition=homo "$dyn"
    table --name dyncavg experiment=fedlap/table3 profile=paper dataset=mnist partition=homo "$dyn"
}
step_fedlap_mnist_feddyn_bayes_admm() {   # gaps.md#fedlap-table3-feddyn: MNIST (and FMNIST 10 %) FedDyn as the FedLap group's
                                          # bayes-admm code runs it (alpha_k = alpha N_k/N; the server adds 1/K of the drift)
    local dyn='aggregators=[{name:feddyn,alpha:${hp.dyn_alpha},weight_decay:${hp.dyn_wd},variant:bayes_admm}]'
    local mh=(profile=paper dataset=mnist partition=homo "$dyn")
    run --name dynbadmm experiment=fedlap/table3 "${mh[@]}"   # 50 rounds: Table 3
    run --name dynbadmm experiment=fedlap/table1 "${mh[@]}"   # 20 rounds: Tables 1, 2 and 5
    local fm=(profile=paper dataset=fmnist partition=homo,size_class_dirichlet num_clients=10 "$dyn")
    run --name dynbadmm experiment=fedlap/table1 "${fm[@]}"   # Fashion-MNIST 10 %, 50 rounds: Tables 1, 2, 3 and 5
    # MNIST heterogeneous (50 rounds, Tables 1, 2, 3 and 5): the preset's FedDyn needs 18-44 rounds to 97.5 % (paper 18)
    local mhet=(profile=paper dataset=mnist partition=size_class_dirichlet "$dyn")
    run --name dynbadmm experiment=fedlap/table1 "${mhet[@]}"
    for t in table1 table2 table3 table5; do
        table --name dynbadmm experiment=fedlap/$t "${mh[@]}"
        table --name dynbadmm_fmnist experiment=fedlap/$t "${fm[@]}"
        table --name dynbadmm_mnisthet experiment=fedlap/$t "${mhet[@]}"
    done
    # Fig. 1's weight-decay curves with this FedDyn (the wd = 1e-5 curve is the Table 1 run above)
    local fig='aggregators=[{name:feddyn,alpha:${hp.dyn_alpha},weight_decay:${hp.dyn_wd},variant:bayes_admm},{name:feddyn,alpha:${hp.dyn_alpha},weight_decay:1.0e-4,variant:bayes_admm},{name:feddyn,alpha:${hp.dyn_alpha},weight_decay:1.0e-6,variant:bayes_admm},{name:feddyn,alpha:${hp.dyn_alpha},weight_decay:0.0,variant:bayes_admm}]'
    run --name dynbadmm experiment=fedlap/figure1 profile=paper "$fig"
    table --name dynbadmm experiment=fedlap/figure1 profile=paper "$fig"
}
step_fedlap_table5_valnll_mnist() {   # gaps.md#fedlap-table5: the caption's "validation NLL" as a 20 % hold-out of the
                                      # training set (session 26's Fashion-MNIST reading) on MNIST heterogeneous, where
                                      # FedAvg and FedProx are the open cells; save_model: scripts/gaps/fedlap_val_vs_test_nll.py
                                      # scores the same weights on test. Those two first, then FedLap and FedLap-Cov.
    local open='aggregators=[fedavg,{name:fedprox,mu:${hp.prox},scale:sum}]'
    local lap='aggregators=[{name:fedlap,delta:${hp.delta},rho:${hp.rho}},{name:fedlap_cov,delta:${hp.delta}}]'
    local mhet=(profile=paper dataset=mnist partition=size_class_dirichlet num_clients=10 tuning_val.fraction=0.2)
    run --name valnll_mnisthet experiment=fedlap/table5 "${mhet[@]}" save_model=true "$open"
    run --name valnll_mnisthet experiment=fedlap/table5 "${mhet[@]}" save_model=true "$lap"
    local both='aggregators=[fedavg,{name:fedprox,mu:${hp.prox},scale:sum},{name:fedlap,delta:${hp.delta},rho:${hp.rho}},{name:fedlap_cov,delta:${hp.delta}}]'
    table --name valnll_mnisthet experiment=fedlap/table5 "${mhet[@]}" "$both"
}
appd2_whatif() {   # an App. D.2 what-if with FedDyn: name, profile, the aggregator list (measured against the delta = 0 MAP)
    local sweeps="table.sweeps=[{eval.map_reference:[0.0],aggregators:[\"[$3]\"]}]"
    run --name "$1" experiment=fedlap/appD2 profile="$2" "$sweeps"
    table --name "$1" experiment=fedlap/appD2 profile="$2" "$sweeps"
}
step_fedlap_appD2() {           # App. D.2 (text): rounds to within 1 % of the centralised MAP's train NLL, test fold 4
    run experiment=fedlap/appD2 profile=quick     # the first 100 of the 1000 rounds
    table experiment=fedlap/appD2 profile=quick
    # what-if: FedDyn as bayes-admm runs it (gaps.md#fedlap-appd2), the first 100 rounds
    appd2_whatif dynbadmm quick '{name:feddyn,alpha:1.0e-3,weight_decay:0.0,variant:bayes_admm},{name:feddyn,alpha:1.0e-4,weight_decay:0.0,variant:bayes_admm},{name:feddyn,alpha:1.0e-5,weight_decay:0.0,variant:bayes_admm}'
    run experiment=fedlap/appD2 profile=paper
    table experiment=fedlap/appD2 profile=paper
    # what-if: FedDyn at alpha above the UCI grid (10, 100, 1000x its largest; gaps.md#fedlap-appd2), the first 100
    # rounds for both FedDyns, then all 1000 for the two largest of the preset's (not within 1 % at round 100)
    local dyn='{name:feddyn,alpha:1.0e-2,weight_decay:0.0},{name:feddyn,alpha:1.0e-1,weight_decay:0.0},{name:feddyn,alpha:1.0,weight_decay:0.0}'
    appd2_whatif dynalpha quick "$dyn"
    appd2_whatif dynbadmmalpha quick "${dyn//weight_decay:0.0/weight_decay:0.0,variant:bayes_admm}"
    appd2_whatif dynalpha paper "${dyn#*\},}"
    # bayes-admm's FedDyn between its last converging alpha (1e-3) and its first worsening one (1e-2), the first 100
    # rounds; then all 1000 rounds for its smallest UCI-grid alpha and its first worsening one
    local fine='{name:feddyn,alpha:2.0e-3,weight_decay:0.0,variant:bayes_admm},{name:feddyn,alpha:3.0e-3,weight_decay:0.0,variant:bayes_admm},{name:feddyn,alpha:5.0e-3,weight_decay:0.0,variant:bayes_admm}'
    local ends='{name:feddyn,alpha:1.0e-5,weight_decay:0.0,variant:bayes_admm},{name:feddyn,alpha:1.0e-2,weight_decay:0.0,variant:bayes_admm}'
    appd2_whatif dynbadmmfine quick "$fine"
    appd2_whatif dynbadmmalpha paper "$ends"
}
step_fedlap_figure1() {
    run experiment=fedlap/figure1 profile=paper
    table experiment=fedlap/figure1 profile=paper
}
step_fedfisher_fmnist() {        # Tables 2, 4, 5 (4 and 5 reuse Table 2's cached clients) and Fig. 1a
    run experiment=fedfisher/table2 profile=paper dataset=fmnist "$FEDFISHER"
    run experiment=fedfisher/table4 profile=paper dataset=fmnist
    run experiment=fedfisher/table5 profile=paper dataset=fmnist
    table experiment=fedfisher/table2 profile=paper
    table experiment=fedfisher/table4 profile=paper
    table experiment=fedfisher/table5 profile=paper
}
step_fedfisher_figure1() {       # Fig. 1a (50 seeds) for m <= 1024 (about 30 CPU s a seed for all 7 widths) and 1b
                                 # (10 seeds x 14 K at m = 512, about 10 CPU min), synthetic
    for s in 0 10 20 30 40; do
        for w in 16 32 64 128 256 512 1024; do
            run experiment=fedfisher/figure1a profile=paper model.width=$w "seed=range($s,$((s + 10)))"
        done
    done
    run experiment=fedfisher/figure1b profile=paper
    # gaps.md#fedfisher-figure1b, a what-if (not the paper's m): Theorem 1's rising term is O(1/m), so at m = 64 the
    # U-shape in K should be larger than at the paper's m = 512
    run --name m64 experiment=fedfisher/figure1b profile=paper 'model.width=choice(64)'
    table experiment=fedfisher/figure1a profile=paper
    table experiment=fedfisher/figure1b profile=paper
    table --name m64 experiment=fedfisher/figure1b profile=paper 'model.width=choice(64)'
}
step_fedfisher_figure1_wide() {  # Fig. 1a's two widest m = 2048, 4096 (about 70 s and 300 s a seed), 10 seeds at a time
    for s in 0 10 20 30 40; do
        for w in 2048 4096; do
            run experiment=fedfisher/figure1a profile=paper model.width=$w "seed=range($s,$((s + 10)))"
        done
    done
    table experiment=fedfisher/figure1a profile=paper
}
step_fedlpa_figure1_mnist() {    # Figs. 1 and 4 (t-SNE of FedLPA's global and local models) and Fig. 5's FedAvg, FedNova and
                                 # SCAFFOLD panels: MNIST, beta = 0.05, seed 0, 200 local epochs (one client stage, about
                                 # 30 CPU min); FedProx's four mu (a 200-epoch stage each) and DENSE left out
    run experiment=fedlpa/figure1 profile=paper 'aggregators=[fedlpa,fedavg,fednova,scaffold]'
    table experiment=fedlpa/figure1 profile=paper
}
step_fedlpa_table11_short() {     # Table 11's 10- and 20-epoch columns (FedLPA vs FedOV, MNIST #C=2, 10 clients, 3 seeds; FedOV
                                 # trains its own C+1-class client stage with outliers and adversarial steps, then distils);
                                 # the 50-200-epoch columns need a GPU (a 200-epoch FedOV stage: 3-6 CPU h)
    run experiment=fedlpa/table11 profile=paper 'local.epochs=choice(10,20)'
    table experiment=fedlpa/table11 profile=paper
}
# Fig. 2's series, split so that two cores run them side by side: the preset's FedLPA series (about 2 CPU h a seed:
# start it when a session starts) and its 8 baseline series (about 1.3 h each); the ids are the preset's own series'
FIG2_FEDLPA='aggregators=[{name:fedlpa,posterior_term:detached_as_released,server_dtype:float32}]'
FIG2_REFERENCE='aggregators=[{name:fedlpa,posterior_term:detached_as_released,server_dtype:float32,reference_solve:cg}]'
# the FedLPA series with GD's step clamped below each layer's stability limit: seed 1's released fixed step diverges
FIG2_STABLE='aggregators=[{name:fedlpa,posterior_term:detached_as_released,server_dtype:float32,gd_step:stable}]'
FIG2_BOTH_STEPS='aggregators=[{name:fedlpa,posterior_term:detached_as_released,server_dtype:float32},{name:fedlpa,posterior_term:detached_as_released,server_dtype:float32,gd_step:stable}]'
# the two baseline series the figure's claims read first (FedLPA-then-FedAvg against FedAvg), then the other six
FIG2_CLAIMED='aggregators=[fedavg,{name:fedlpa_then_fedavg,server_dtype:float32}]'
# SCAFFOLD under the released correction (its own step: the paper's corrected gradient diverged, gaps.md#fedlpa-figure2)
FIG2_SCAFFOLD='aggregators=[{name:scaffold,correction:after_step}]'
FIG2_OTHERS='aggregators=[fednova,{name:fedprox,mu:0.001},{name:fedprox,mu:0.01},{name:fedprox,mu:0.1},{name:fedprox,mu:1.0}]'
step_fedlpa_figure2_mnist() {     # Fig. 2: 50 rounds x 10 local epochs, MNIST beta = 0.5, 9 series x 3 seeds (each series its
                                 # own run and record, resumable round by round, so the step resumes series by series)
    step_fedlpa_figure2_fedlpa
    step_fedlpa_figure2_scaffold
    step_fedlpa_figure2_baselines
}
step_fedlpa_figure2_fedlpa() {    # Fig. 2's FedLPA series, seeds 0 and 2: seed 1's released fixed-step GD diverges in round
                                 # 46 (deterministic, about 2.3 CPU h to get there; gaps.md#fedlpa-figure2)
    run experiment=fedlpa/figure2 profile=paper "$FIG2_FEDLPA" "seed=0,2"
    table experiment=fedlpa/figure2 profile=paper
}
step_fedlpa_figure2_reference() { # the seed-0 FedLPA series again with every round's system also solved exactly (CG,
                                  # evaluated, not carried): are its dips the GD solve's? (gaps.md#fedlpa-figure2)
    run experiment=fedlpa/figure2 profile=paper "$FIG2_REFERENCE" seed=0
    table experiment=fedlpa/figure2 profile=paper "$FIG2_REFERENCE" seed=0 '+table.plots=[fedlpa_solver_rounds]' --name reference
}
step_fedlpa_figure2_stable() {    # the FedLPA series again, seeds 0-2, with gd_step: stable (per layer min(gd_lr, 1/L)):
                                  # does seed 1 get past round 46, and do the dips (rounds whose GD solve stopped far
                                  # from the solution) shrink? About 2 CPU h a seed (gaps.md#fedlpa-figure2)
    run experiment=fedlpa/figure2 profile=paper "$FIG2_STABLE"
    table experiment=fedlpa/figure2 profile=paper "$FIG2_BOTH_STEPS" '+table.label_keys={fedlpa:[gd_step]}' --name stable
}
step_fedlpa_figure2_scaffold() {  # Fig. 2's SCAFFOLD series, seeds 0-2, with NIID-Bench's correction after each SGD step;
                                  # beside it the paper's corrected gradient through momentum 0.9 (seed 0, session 49)
    run experiment=fedlpa/figure2 profile=paper "$FIG2_SCAFFOLD"
    table experiment=fedlpa/figure2 profile=paper
    table experiment=fedlpa/figure2 profile=paper 'aggregators=[scaffold,{name:scaffold,correction:after_step}]' \
        '+table.label_keys={scaffold:[correction]}' --name scaffold_correction
}
step_fedlpa_figure2_baselines() { # Fig. 2's other 7 series, seeds 0-2: the two the claims read first
    run experiment=fedlpa/figure2 profile=paper "$FIG2_CLAIMED"
    run experiment=fedlpa/figure2 profile=paper "$FIG2_OTHERS"
    table experiment=fedlpa/figure2 profile=paper
}
step_fedbens_tables567_fmnist() {   # Tables 6 (5x smaller client data), 7 (customised M), 5 (FedFisher K-FAC over 5
                                    # rounds); alpha 0.05, 0.4 x 3 seeds; their FedFisher / FedBEns M = 5 runs are Table 1's
    local m3first='aggregators=[{name:fedbens,members_per_client:[3,3,1,1,1],member_init:perturb}]'
    for t in 6 7 5; do
        run experiment=fedbens/table$t profile=paper dataset=fmnist
    done
    # gaps.md#fedbens-table7: which clients get M = 3 is unstated; the reading gives it to clients 0 and 1
    run --name m3first experiment=fedbens/table7 profile=paper dataset=fmnist "$m3first"
    # gaps.md#fedbens-table6: the reduced data on other draws of the split (alpha 0.05, training seed 0)
    run --name splitdraw experiment=fedbens/table6 profile=paper dataset=fmnist partition.alpha=0.05 \
        'partition.fixed_seed=choice(0,1,2,4,5)' seed=0
    for t in 6 7 5; do
        table experiment=fedbens/table$t profile=paper dataset=fmnist
    done
    table --name m3first experiment=fedbens/table7 profile=paper dataset=fmnist "$m3first"
    table --name splitdraw experiment=fedbens/table6 profile=paper dataset=fmnist partition.alpha=0.05 \
        'partition.fixed_seed=choice(0,1,2,4,5)' seed=0
}
step_fedbens_figures_fmnist() {   # Figs. 4 (T), 5 (sigma^2), 3 (Diag+Full vs K-FAC over M), 2 (M, 4 alpha x 5 seeds): server
                                  # sweeps on Table 1's members and curvature (client-stage cache; retrained where absent)
    for f in 4 5 3 2; do
        run experiment=fedbens/figure$f profile=paper dataset=fmnist
    done
    for f in 4 5 3 2; do
        table experiment=fedbens/figure$f profile=paper dataset=fmnist
    done
}
step_fedlpa_table6_fmnist() {    # 9 partitions x 3 seeds, one partition and seed per call (each a few CPU minutes)
    for seed in 0 1 2; do
        for p in "${LPA_PARTITIONS[@]}"; do
            run experiment=fedlpa/table6 profile=paper dataset=fmnist "partition.spec='$p'" "$FEDLPA" seed=$seed
        done
    done
    table experiment=fedlpa/table6 profile=paper "$FEDLPA"   # one table for every data set run
}
step_fedlpa_table6_mnist() {     # MNIST, 9 partitions x 3 seeds, one partition (its 3 seeds) per call, so each
                                 # finished call completes a row's cells
    for p in "${LPA_PARTITIONS[@]}"; do
        run experiment=fedlpa/table6 profile=paper dataset=mnist "partition.spec='$p'" "$FEDLPA"
    done
    table experiment=fedlpa/table6 profile=paper "$FEDLPA"
}
step_fedlpa_table6_fmnist_tuned() {   # FedProx's mu chosen on validation (gaps.md#fedlpa-table6-fedprox); 36 selection
                                      # runs of ~90 s, the final runs are step fedlpa_table6_fmnist's
    run experiment=fedlpa/table6 profile=paper dataset=fmnist tuning=on 'aggregators=[fedavg,fedprox]'
    table experiment=fedlpa/table6 profile=paper tuning=on 'aggregators=[fedavg,fedprox]'   # every data set: one table
}
step_fedlpa_table6_mnist_tuned() {
    run experiment=fedlpa/table6 profile=paper dataset=mnist tuning=on 'aggregators=[fedavg,fedprox]'
    table experiment=fedlpa/table6 profile=paper tuning=on 'aggregators=[fedavg,fedprox]'
}
step_fedlpa_table5_tuned() {   # the same for Table 5 (10 local epochs; its FedProx cells carry verdict one_number until then)
    run experiment=fedlpa/table5 profile=paper dataset=fmnist tuning=on 'aggregators=[fedavg,fedprox]'
    run experiment=fedlpa/table5 profile=paper dataset=mnist tuning=on 'aggregators=[fedavg,fedprox]'
    table experiment=fedlpa/table5 profile=paper tuning=on 'aggregators=[fedavg,fedprox]'
}
step_fedlpa_table5_fmnist() {    # 9 partitions x 3 seeds (10 local epochs; about 7 CPU minutes a partition and seed)
    for p in "${LPA_PARTITIONS[@]}"; do
        run experiment=fedlpa/table5 profile=paper dataset=fmnist "partition.spec='$p'" "$FEDLPA_CG"
    done
    table experiment=fedlpa/table5 profile=paper
}
step_fedlpa_table5_fmnist_bestof() {   # gaps.md#fedlpa-table5-bestof: FedLPA reported as the released code reports it,
                                       # max(test acc of GD, of EA); beta=0.3 first (its cell is outside), on the
                                       # client stages of step fedlpa_table5_fmnist (cached in outputs/)
    local bestof='aggregators=[{name:fedlpa,report:best_of_ea_gd_on_test}]'
    for p in 'beta=0.3' "${LPA_PARTITIONS[@]}"; do
        run --name bestof experiment=fedlpa/table5 profile=paper dataset=fmnist "partition.spec='$p'" "$bestof"
    done
    table --name bestof experiment=fedlpa/table5 profile=paper dataset=fmnist "$bestof"
}
step_fedlpa_table6_mnist_bestof() {   # the released reporting rule on Table 6's MNIST clients (gaps.md#fedlpa-table6-mnist):
                                      # beta=0.05 first (its cell is outside), then the partitions in order
    local bestof='aggregators=[{name:fedlpa,report:best_of_ea_gd_on_test}]'
    for p in 'beta=0.05' "${LPA_PARTITIONS[@]}"; do
        run --name bestof experiment=fedlpa/table6 profile=paper dataset=mnist "partition.spec='$p'" "$bestof"
    done
    table --name bestof experiment=fedlpa/table6 profile=paper dataset=mnist "$bestof"
}
step_fedlpa_table5_mnist() {     # MNIST, 9 partitions x 3 seeds at 10 local epochs
    for p in "${LPA_PARTITIONS[@]}"; do
        run experiment=fedlpa/table5 profile=paper dataset=mnist "partition.spec='$p'" "$FEDLPA_CG"
    done
    table experiment=fedlpa/table5 profile=paper
}
step_fedbens_table1_fmnist() {   # 4 alpha x 5 seeds, then Tables 8 and 3 (alpha 0.05, 0.4; Table 1's clients)
    # alpha 0.2 before Table 3: Table 3 reuses Table 1's client stages only while outputs/ still caches them, and a
    # fresh machine retrains them anyway (6 seeds, 2 cells), while alpha 0.2 adds a whole Table 1 row
    for a in 0.1 0.4 0.05 0.2; do
        run experiment=fedbens/table1 profile=paper dataset=fmnist partition.alpha=$a "$FEDBENS"
    done
    run experiment=fedbens/table8 profile=paper dataset=fmnist   # Table 1's FedBEns runs (alpha 0.05, 0.4; seeds 0-2)
    run experiment=fedbens/table3 profile=paper dataset=fmnist   # Table 1's client stages, no validation set
    table experiment=fedbens/table1 profile=paper dataset=fmnist
    table experiment=fedbens/table3 profile=paper dataset=fmnist
    table experiment=fedbens/table8 profile=paper dataset=fmnist
}
step_fedbens_table2_fmnist() {   # Table 2: alpha = 0.3, C = 10, 20, 40 clients; seed by seed, so that every C row gets a
                                 # seed before any gets a second (about 25 CPU minutes a cell: 5 member stages)
    for seed in 0 1 2 3 4; do
        for c in 10 20 40; do
            run experiment=fedbens/table2 profile=paper dataset=fmnist num_clients=$c "$FEDBENS" seed=$seed
        done
    done
    table experiment=fedbens/table2 profile=paper dataset=fmnist
}

step_fedfisher_table6_mnist() {  # Table 6: the GMI model-inversion study (clients, FedFisher-K-FAC, WGAN-GP, three attacks),
                                 # MNIST, 3 seeds; a study preset, so one reproduce call runs it all
    run experiment=fedfisher/table6 profile=paper
    # gaps.md#fedfisher-table6 hypothesis 1, a what-if (not the paper's setting): the server's 5000 aux samples drawn
    # from every client, client 1's 3s included (seed 0)
    run --name auxall experiment=fedfisher/table6 profile=paper study.aux_pool=all_clients seed=0
    table experiment=fedfisher/table6 profile=paper
    table --name auxall experiment=fedfisher/table6 profile=paper study.aux_pool=all_clients seed=0
}

step_fedlpa_table9_fmnist() {    # Table 9: 5 clients, 200 local epochs, 6 beta partitions x 3 seeds, seed-major; FedProx (4 mu, a
                                 # 200-epoch stage each) and DENSE left out: about 1 CPU hour a run (one 200-epoch stage)
    local base='aggregators=[fedlpa,fedavg,fednova,scaffold]'
    for seed in 0 1 2; do
        for p in 'beta=0.01' 'beta=0.05' 'beta=0.1' 'beta=0.3' 'beta=0.5' 'beta=1.0'; do
            run experiment=fedlpa/table9 profile=paper "partition.spec='$p'" "$base" seed=$seed
        done
    done
    table experiment=fedlpa/table9 profile=paper
}

step_fedlpa_table10_short() {    # Table 10 (beta = 0.001), its 10- and 20-epoch columns on MNIST and FMNIST, 3 seeds; the
                                 # 50-200-epoch columns (about 0.5-2 CPU h a run) and DENSE are left out
    for e in 10 20; do
        for d in fmnist mnist; do
            run experiment=fedlpa/table10 profile=paper dataset=$d local.epochs=$e "$FEDLPA_CG"
        done
    done
    table experiment=fedlpa/table10 profile=paper
    table --name cg experiment=fedlpa/table10 profile=paper 'aggregators=[{name:fedlpa,solver:cg}]'   # gaps.md#fedlpa-table10
}

step_fedlpa_table10_tuned() {    # FedProx's mu chosen on a 20 % hold-out for the columns run here (10, 20 local epochs,
                                 # FMNIST and MNIST), as in Tables 5-6: 16 selection runs of 40-90 s; finals = the step above's
    for e in 10 20; do
        for d in fmnist mnist; do
            run experiment=fedlpa/table10 profile=paper dataset=$d local.epochs=$e tuning=on 'aggregators=[fedavg,fedprox]'
        done
    done
    table experiment=fedlpa/table10 profile=paper tuning=on 'aggregators=[fedavg,fedprox]'
}

step_fedlpa_table10_long() {    # Table 10's 50-, 100- and 200-epoch columns on MNIST and FMNIST, 3 seeds, every method that
                                 # trains the one shared stage (FedProx's four mu would each train their own: 5x the cost;
                                 # DENSE needs a GPU). Session 28 ran 15 of the 18 runs on an H100 (CAMPAIGN_HW=
                                 # "hardware=cuda": 50-140 s a run, three at once); a 200-epoch run here is ~30 CPU min
    for e in 50 100 200; do
        for d in mnist fmnist; do
            run experiment=fedlpa/table10 profile=paper dataset=$d local.epochs=$e "$FEDLPA_CG_ONESTAGE"
        done
    done
    table experiment=fedlpa/table10 profile=paper
    table --name cg experiment=fedlpa/table10 profile=paper 'aggregators=[{name:fedlpa,solver:cg}]'
}

fedlpa_onestage() {   # FedLPA's long one-round tables (7, 8): the given data sets x 9 partitions x 3 seeds, the methods
                      # that share one client stage, then the table and its CG reading
    local t=$1; shift
    for d in "$@"; do
        run experiment=fedlpa/$t profile=paper dataset=$d "$FEDLPA_CG_ONESTAGE"
    done
    table experiment=fedlpa/$t profile=paper
    table --name cg experiment=fedlpa/$t profile=paper 'aggregators=[{name:fedlpa,solver:cg}]'
}

step_fedlpa_table7_onestage() {  # Table 7 (50 local epochs) on FMNIST and MNIST, 9 partitions x 3 seeds, every method that
                                 # trains the one shared stage (FedProx's four mu and DENSE left out, as in Table 10's long
                                 # columns). Session 30 ran FMNIST's 27 runs and MNIST's first 11 on an H100
                                 # (CAMPAIGN_HW="hardware=cuda"); a run here is about 10 CPU min (one 50-epoch stage)
    fedlpa_onestage table7 fmnist mnist
}

step_fedlpa_table8_onestage() {  # Table 8 (100 local epochs) on MNIST and FMNIST, 9 partitions x 3 seeds, the methods of
                                 # Table 7's one shared stage. Session 61 ran MNIST's first 18 runs on an H200 (scripts/
                                 # device_campaign.sh, three at once, 76-121 s a partition's 3 seeds); here a run is one
                                 # 100-epoch stage, about 15-30 CPU min
    fedlpa_onestage table8 mnist fmnist
}

step_fedlpa_tables1_3_fmnist() { # Table 1's FMNIST row (200 local epochs, 9 partitions x 3 seeds, the methods of one shared
                                 # stage; FedProx's four mu and DENSE left out) and Table 3 (FedLPA at lambda 0.01 / 0.001 /
                                 # 0.0001) in one list: Table 3's runs are Table 1's settings (same run ids), so each
                                 # (partition, seed) trains its 200-epoch stage once; about 30-45 CPU min a run here
    run experiment=fedlpa/table1 profile=paper dataset=fmnist "${FEDLPA_CG_ONESTAGE%]},{name:fedlpa,damping:0.01},{name:fedlpa,damping:0.0001}]"
    table experiment=fedlpa/table1 profile=paper
    table --name cg experiment=fedlpa/table1 profile=paper 'aggregators=[{name:fedlpa,solver:cg}]'
    table experiment=fedlpa/table3 profile=paper
}

step_fedlpa_table1_mnist_beta005() {  # Table 1's MNIST beta = 0.05 cells beyond Fig. 1's seed-0 record (its run id is
                                      # Table 1's): seeds 1-2 with the one-stage list, so the row has 3 seeds; about
                                      # 30-45 CPU min a run here
    for s in 1 2; do
        run experiment=fedlpa/table1 profile=paper dataset=mnist "partition.spec='beta=0.05'" seed=$s "$FEDLPA_CG_ONESTAGE"
    done
    table experiment=fedlpa/table1 profile=paper
    table --name cg experiment=fedlpa/table1 profile=paper 'aggregators=[{name:fedlpa,solver:cg}]'
}
step_fedlpa_table2_onestage() {  # Table 2 (FMNIST, 20 and 50 clients, 200 local epochs, 9 partitions x 3 seeds less the
                                 # 50-client beta = 0.01 row, which no NIID-Bench draw makes: 51 runs), the
                                 # methods of one shared stage (FedProx's four mu and DENSE left out); after
                                 # fedlpa_tables1_3_fmnist: about 30-45 CPU min a run here (the same 60,000 samples x 200 epochs)
    fedlpa_onestage table2 fmnist
}

step_fola_figures10_12() {       # §IV-E softmax-regression study (MNIST, 2 clients): Figs. 10-11 (one study run: 7
                                 # methods x 10 rounds, the exact 7850-parameter Hessian on every local step of the online
                                 # styles) and Fig. 12 (alpha 0.1, 1, 10: 15 rounds, then the round-16 LF clients)
    run experiment=fola/figure10 profile=paper
    run experiment=fola/figure12 profile=paper
    table experiment=fola/figure10 profile=paper
    table experiment=fola/figure11 profile=paper
    table experiment=fola/figure12 profile=paper
}
step_fola_figures3_4() {         # reduced grid (fola.md §6 R1): 450 (alpha, N, lr, B, seed) x E = 1, 5, 10, 15, 20, one
                                 # round; each setting trains once for its five E and three methods (share_epochs, FOLA's
                                 # stage serves FedAvg's), its stages kept within the preset's cache_max_gb
    # N = 10 (Fig. 4's fixed N, fola.md) across every alpha first, seed 0 then 1-2, so the claims by alpha can be
    # read early; then the rest of the grid (finished runs are skipped)
    run experiment=fola/figure3 profile=reduced num_clients=10 seed=0
    run experiment=fola/figure3 profile=reduced num_clients=10
    run experiment=fola/figure3 profile=reduced
    table experiment=fola/figure3 profile=reduced
    table experiment=fola/figure4 profile=reduced
}
step_fola_figure3_gridedge() {   # gaps.md#fola-figures3-4: FedAvg's best at alpha = 0.1 sits on the reduced grid's corner
                                 # (lr 0.1, B 32): FedAvg alone at N = 5 and 100 with the paper's lr 1 and B 8 too
    run --name gridedge experiment=fola/figure3 profile=reduced partition.alpha=0.1 seed=0 'local.lr=1.0,0.1' \
        'local.batch_size=8,32' 'num_clients=5,100' 'aggregators=[fedavg]'
    run --name gridedge experiment=fola/figure3 profile=reduced partition.alpha=0.1 'seed=1,2' 'local.lr=choice(0.1)' \
        'local.batch_size=choice(8)' 'num_clients=5,100' 'aggregators=[fedavg]'
    table --name gridedge experiment=fola/figure3 profile=reduced partition.alpha=0.1 'seed=0,1,2' 'local.lr=1.0,0.1' \
        'local.batch_size=8,32' 'num_clients=5,100' 'aggregators=[fedavg]'
}
step_fola_figure3_coarse() {     # gaps.md#fola-figures3-4: FedAvg's best at alpha = 0.1 rises with N; is it the clients'
                                 # number and size or their label mixes? N = 20 and 100 clients cut from the N = 5 split
    run --name coarse5 experiment=fola/figure3 profile=reduced partition.alpha=0.1 'seed=0,1,2' 'local.lr=choice(0.1)' \
        'local.batch_size=choice(32)' 'num_clients=20,100' +partition.coarse_clients=5 'aggregators=[fedavg]'
    table --name coarse5 experiment=fola/figure3 profile=reduced partition.alpha=0.1 'seed=0,1,2' \
        'local.lr=choice(0.1)' 'local.batch_size=choice(32)' 'num_clients=20,100' +partition.coarse_clients=5 \
        'aggregators=[fedavg]'
    # dose-response: N = 100 clients with the label mixes of 5, 20 and 50 (100 = the released split's own runs)
    run --name coarsemix experiment=fola/figure3 profile=reduced partition.alpha=0.1 'seed=0,1,2' \
        'local.lr=choice(0.1)' 'local.batch_size=choice(32)' 'num_clients=choice(100)' '+partition.coarse_clients=5,20,50' \
        'aggregators=[fedavg]'
    table --name coarsemix experiment=fola/figure3 profile=reduced partition.alpha=0.1 'seed=0,1,2' \
        'local.lr=choice(0.1)' 'local.batch_size=choice(32)' 'num_clients=choice(100)' '+partition.coarse_clients=5,20,50' \
        'aggregators=[fedavg]'
}
step_fola_figure5() {            # lambda chosen on validation per N (tuning=on); N = 10 first
    for n in 10 5 20 50 100; do
        run experiment=fola/figure5 profile=paper tuning=on num_clients=$n
    done
    table experiment=fola/figure5 profile=paper tuning=on   # every N; a selection under way publishes its runs
}
step_fola_figure5_lambda1000() {   # gaps.md#fola-figure5: N = 100's hold-out chose lambda = 100 over 1000 by one sample of
                                   # 12,000; FOLA at lambda = 1000 (no selection), 3 seeds, to see if the round-50 verdict
                                   # depends on that tie-break
    local fola='aggregators=[{name:fola,lambda_prior:${hp.fola_lambda},prior_grad:live,round_scaling:code,fisher:{mode:online,grad:minibatch_sq,normalize:none,gradient:task,chunk_size:256}}]'
    run --name lambda1000 experiment=fola/figure5 profile=paper num_clients=100 hp.fola_lambda=1000.0 "$fola"
    table --name lambda1000 experiment=fola/figure5 profile=paper num_clients=100 hp.fola_lambda=1000.0 "$fola"
}

STEPS=(fedlap_table1_tabular fedlap_table1_heart_standardize fedlap_credit_fold4 fedlap_table1_fmnist fedlap_table1_fmnist_rawpixels fedfisher_fmnist fedfisher_figure1 fedlpa_table6_fmnist
       fedbens_table1_fmnist fedbens_tables567_fmnist fedlpa_table5_fmnist fedlpa_table5_fmnist_bestof fedlpa_table6_mnist fedlpa_table6_mnist_bestof fedlpa_table5_mnist fedlap_table1_mnist fedlap_figure1 fedlpa_table6_fmnist_tuned fedlpa_table6_mnist_tuned fedlpa_table5_tuned
       fola_figure5 fedlap_table3_mnist_homog fedlap_table3_feddyn_client_average fedlap_mnist_feddyn_bayes_admm fedlap_appD2 fedbens_figures_fmnist fedbens_table2_fmnist fedfisher_table6_mnist fedlpa_figure1_mnist fedlpa_table9_fmnist fedfisher_figure1_wide fedlpa_table10_short fedlpa_table10_tuned
       fedlap_table1_fmnist100 fedlpa_table10_long fedlap_appE5 fedlpa_table11_short fedlpa_figure2_mnist fedlpa_figure2_fedlpa fedlpa_figure2_reference fedlpa_figure2_scaffold fedlpa_figure2_baselines fedlpa_figure2_stable fedlpa_table7_onestage fedlpa_table8_onestage
       fola_figures10_12 fola_figures3_4 fola_figure3_gridedge fola_figure3_coarse fedlap_table5_valnll_mnist fola_figure5_lambda1000
       fedlpa_tables1_3_fmnist fedlpa_table2_onestage fedlpa_table1_mnist_beta005)

usage() {
    echo "usage: bash scripts/campaign.sh [--collect | --status] STEP... | all | --list | --park" >&2
    echo "steps: ${STEPS[*]}" >&2
}

[ $# -eq 0 ] && { usage; exit 2; }
if [ "$1" = "--list" ]; then
    for s in "${STEPS[@]}"; do
        echo "$s:"
        declare -f "step_$s" | sed -n '3,$p' | sed '$d' | sed 's/^ */    /'
    done
    exit 0
fi
if [ "$1" = "--park" ]; then   # before a session ends: unfinished runs' checkpoints to results/checkpoints (commit it)
    exec "$PY" scripts/park_checkpoints.py --outputs "${FEDBENCH_OUTPUTS:-outputs}"
fi
if [ "$1" = "--collect" ]; then
    COLLECT=1
    shift
elif [ "$1" = "--status" ]; then
    STATUS=1
    shift
fi
[ "${1:-}" = "all" ] && set -- "${STEPS[@]}"
# the loop variable has a name no step uses: the steps' own loops (for s in ...) share the script's globals
for campaign_step in "$@"; do   # every name is checked before anything runs
    declare -F "step_$campaign_step" > /dev/null || {
        echo "campaign.sh: error: unknown step '$campaign_step'" >&2; usage; exit 2; }
done
for campaign_step in "$@"; do
    "step_$campaign_step"
    if [ -z "$COLLECT$STATUS" ]; then
        # a reproduce call writes its table under its own, narrower overrides (one alpha, one data set); the step's
        # collect calls restore the committed collections and publish the step's finished records
        COLLECT=1
        "step_$campaign_step"
        COLLECT=""
    fi
done

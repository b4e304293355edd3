"""Gap experiment (gaps.md#fedbens-table7): which member of a client's mixture the FedBEns server listens to.

FedBEns' server maximises Σ_c log Σ_m (1/M_c) N(θ; μ_cm, Λ_cm⁻¹) with normalised densities, so each member carries
½ log det Λ_cm. Hypothesis: among a client's near-identical replicas (Table 7's customised M) the log-dets differ by
many nats, so the sharpest replica takes all of the client's responsibility wherever θ is. This wrapper runs run.py
unchanged and prints, for every client with more than one member, at the server's start (the coordinate median) and
at the iterate it keeps: each member's ½ log det Λ, its Mahalanobis term ½ (θ − μ)ᵀ Λ (θ − μ), its responsibility
(softmax over the client's members of const − quad), the members' distances ‖μ_m − μ_0‖, and each member's own
accuracy on the server's validation set. Point FEDBENCH_OUTPUTS
at a folder of its own and keep the campaign's client cache (the members and their curvature are reused):

    FEDBENCH_OUTPUTS=/tmp/resp PYTHONPATH=. python scripts/gaps/fedbens_responsibilities.py \
      paths.cache_dir=/work/campaign/outputs/cache/clients experiment=fedbens/table7 dataset=fmnist \
      partition.alpha=0.4 seed=0 'aggregators=[{name:fedbens,members_per_client:[1,1,1,3,3],member_init:perturb}]' \
      hardware=cpu hardware.num_threads=1
"""
import runpy
import sys
from pathlib import Path

import torch

import fedbench.algorithms.fedbens as fedbens

_optimise = fedbens.optimise_component


def report(obj: "fedbens.ServerObjective", theta: torch.Tensor, label: str) -> None:
    with torch.no_grad():
        quad = 0.5 * obj._quad(theta.detach())
        const = obj.const.to(quad.dtype)
        for c, (a, b) in enumerate(zip(obj.bounds[:-1], obj.bounds[1:])):
            if b - a < 2:
                continue
            half_logdet = [0.5 * float(g.logdet()) for g in obj.comps[c]]
            resp = torch.softmax(const[a:b] - quad[a:b], dim=0)
            dist = [float((g.mean - obj.comps[c][0].mean).norm()) for g in obj.comps[c]]
            print(f"[{label}] client {c}: " + " | ".join(
                f"m{m}: ½logdet {half_logdet[m]:.1f}, quad {float(quad[a + m]):.1f}, resp {float(resp[m]):.3f}, "
                f"|mu_m-mu_0| {dist[m]:.2f}" for m in range(b - a)), flush=True)


def optimise_component(objective, start, **kw):
    if isinstance(objective, fedbens.ServerObjective):
        report(objective, start, "start (median)")
    theta, info = _optimise(objective, start, **kw)
    if isinstance(objective, fedbens.ServerObjective):
        report(objective, theta, f"kept (step {info['best_step']}, val {info['val_accuracy']})")
    return theta, info


_aggregate = fedbens.FedBEns.aggregate


def aggregate(self, messages, state, round_idx):
    # each member alone on the server's validation set (500 training rows): is a replica a worse model than member 0?
    for m in sorted(messages, key=lambda m: m.client_id):
        accs = [self.setup.val_metrics(self.layout.unflatten(g.mean))["accuracy"] for g in m.info["gaussians"]]
        print(f"client {m.client_id}: members' own server-validation accuracy " + ", ".join(f"{a:.1f}" for a in accs),
              flush=True)
    return _aggregate(self, messages, state, round_idx)


fedbens.optimise_component = optimise_component
fedbens.FedBEns.aggregate = aggregate
sys.argv = ["run.py"] + sys.argv[1:]
runpy.run_path(str(Path(__file__).resolve().parents[2] / "run.py"), run_name="__main__")

"""Gap experiment (gaps.md#fedlap-table1): run.py with each client's Adam state carried across rounds.

The FedLap group's follow-up code (team-approx-bayes/bayes-admm, notes/reference-code.md §5) creates a client's Adam
optimiser once, so its moment estimates persist from round to round; fedbench's engine creates a fresh one per round.
This wrapper tests whether that difference explains FedLap Table 1's UCI Credit numbers, without adding an engine
option: it keeps each client's optimiser state between rounds (serial backend, Adam only) and then runs run.py.
The run id is the plain run's, so point FEDBENCH_OUTPUTS at a folder of its own:

    FEDBENCH_OUTPUTS=/tmp/persist PYTHONPATH=. python scripts/gaps/persistent_adam.py experiment=fedlap/table1 \
      dataset=uci_credit partition=uci_inhomogeneous num_clients=10 aggregators=null algorithm=fedavg rounds=50 \
      local.batch_size=4 local.epochs=1 seed=0 hardware=cpu hardware.num_threads=1
"""
import runpy
import sys
import types
from pathlib import Path

import torch

import fedbench.train.engine as engine

STATES = {}       # client id -> its optimiser's state_dict after its last step
CURRENT = [None]  # the optimiser the engine created last


class PersistentAdam(torch.optim.Adam):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.client_id = None
        CURRENT[0] = self

    def step(self, *args, **kwargs):
        out = super().step(*args, **kwargs)
        STATES[self.client_id] = self.state_dict()
        return out


_client_generator = engine.client_generator


def client_generator(seed, round_idx, client_id):
    # the engine creates the optimiser, then asks for the client's random stream: restore that client's state here
    opt = CURRENT[0]
    if isinstance(opt, PersistentAdam):
        opt.client_id = client_id
        if client_id in STATES:
            opt.load_state_dict(STATES[client_id])
    return _client_generator(seed, round_idx, client_id)


# the engine reads torch.optim.Adam through its module global `torch`: give it a view with Adam replaced
optim_view = types.ModuleType("torch.optim")
optim_view.__dict__.update(torch.optim.__dict__)
optim_view.Adam = PersistentAdam
torch_view = types.ModuleType("torch")
torch_view.__dict__.update(torch.__dict__)
torch_view.optim = optim_view
engine.torch = torch_view
engine.client_generator = client_generator

sys.argv = ["run.py"] + sys.argv[1:]
runpy.run_path(str(Path(__file__).resolve().parents[2] / "run.py"), run_name="__main__")

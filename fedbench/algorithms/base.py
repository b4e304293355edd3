"""The one interface every method implements, one-shot (rounds=1) or multi-round.

A round: the server state gives each client its start weights and local objective; the
engine trains all clients; each client turns its trained weights into a ``Message`` (what is
uploaded, bytes counted); the server turns the messages into the next state. Methods
override only the hooks they need.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from fedbench.registry import Registry
from fedbench.train.engine import LocalObjective, TrainResult

Params = Dict[str, Tensor]
ALGORITHMS: Registry = Registry("algorithm")


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a (nested) payload, at the dtype actually sent."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


@dataclass
class Message:
    client_id: int
    num_samples: int
    payload: Dict[str, Any]
    info: Dict[str, Any] = field(default_factory=dict)   # not uploaded: e.g. local steps, train loss

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.payload)


@dataclass(frozen=True)
class ClientProduct:
    """What a method computes per client after local training (curvature, Gram matrices, ...). The round
    loop loads ``at`` into its one shared worker model, calls ``compute(worker)`` and caches the payload with
    the round's client stage, under {stage, "product": name, "client": id, "params": parts}."""

    name: str                                          # the product's name in the cache key
    parts: Optional[Dict[str, Any]]                    # its settings in the cache key; None = never cached
    at: Params                                         # the weights the worker holds when ``compute`` runs
    compute: Callable[[nn.Module], Dict[str, Any]]     # worker -> payload (a dict of tensors)
    label: str = ""                                    # its key in client_message's ``products`` (default: name)
    dtype: Optional[torch.dtype] = None                # worker dtype (None: the template's)

    @property
    def key(self) -> str:
        return self.label or self.name


class Algorithm:
    """Base class; ``setup`` is the run's ``fedbench.fl.loop.FLSetup`` (model, data, clients, device)."""

    name: ClassVar[str] = "base"
    # the method's options: a frozen dataclass read with ``options.read_options`` (defaults: conf/algorithm/<name>.yaml)
    Options: ClassVar[Optional[type]] = None
    # a run killed mid-way may go on from its last saved round (fedbench/fl/resume.py): only for methods whose
    # whole memory across rounds is the state dict, each checked by tests/test_resume.py
    resumable: ClassVar[bool] = False

    def __init__(self, cfg: Mapping[str, Any], setup):
        self.cfg = dict(cfg)
        self.setup = setup

    # --- server side -------------------------------------------------------------------
    def init_state(self, params: Params) -> Dict[str, Any]:
        """Server state before round 1; must hold the global weights under 'params'."""
        return {"params": params}

    def aggregate(self, messages: List[Message], state: Dict[str, Any], round_idx: int) -> Dict[str, Any]:
        raise NotImplementedError

    def predict_params(self, state: Dict[str, Any]) -> Params | List[Params]:
        """Weights to evaluate: one dict, or a list (an ensemble, softmax-averaged)."""
        return state["params"]

    def downlink(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """What the server sends each client at the start of a round (for byte counting)."""
        return {"params": state["params"]}

    # --- client side -------------------------------------------------------------------
    def client_stage_key(self, round_idx: int) -> Optional[Dict[str, Any]]:
        """What, beyond data/split/model/local training/seed, determines this round's trained clients.

        None = not cacheable (the default). Methods whose round-1 local training is plain training
        return {} so that all of them share one cached client stage; methods that change local
        training return the settings that do (e.g. FedProx's mu).
        """
        return None

    def plain_training(self, round_idx: int) -> bool:
        """True when this round's local training is the plain one (plain start, no loss terms) and its step hooks
        only observe (e.g. FOLA's round-1 online Fisher): its cached stage then also serves as the plain stage
        (``client_stage_key`` {}), so FedAvg & co. load these weights instead of training them again."""
        return False

    def start_params(self, state: Dict[str, Any], client_ids: Sequence[int]) -> Params | List[Params]:
        return state["params"]

    # --- several local trainings per client (FedBEns' M members; default: one) ----------
    def num_members(self, round_idx: int) -> int:
        """Trainings per client this round. With M > 1, member 0 starts from ``start_params`` (so it
        is the plain training), member m ≥ 1 from ``member_start_params``, and ``client_message``
        receives ``params`` and ``result`` as lists over members."""
        return 1

    def member_start_params(self, state: Dict[str, Any], client_ids: Sequence[int], member: int,
                            round_idx: int) -> Params | List[Params]:
        raise NotImplementedError

    def member_key(self, member: int) -> Any:
        """What identifies member m ≥ 1's start in the client-stage cache key (its init rule)."""
        return member

    def local_objective(self, state: Dict[str, Any], client_ids: Sequence[int], round_idx: int) -> LocalObjective:
        return LocalObjective()

    def local_train(self, state: Dict[str, Any], client_ids: Sequence[int], round_idx: int, seed: int,
                    progress=None) -> Optional[TrainResult]:
        """A method's own client stage (another model or loss than the engine's, e.g. FedOV's C+1 classes);
        None (the default) = the engine trains ``start_params``. Still cached under ``client_stage_key``."""
        return None

    def stage_client_ids(self, client_ids: Sequence[int]) -> Sequence[int]:
        """The clients whose trained weights the round's client stage holds, in order (one message each):
        every client (the default); ``centralized`` trains one pooled client."""
        return client_ids

    def client_products(self, client_id: int, params: Params | List[Params], state: Dict[str, Any],
                        round_idx: int) -> Sequence[ClientProduct]:
        """What the loop computes for this client after training, before ``client_message`` (default: none)."""
        return ()

    def client_message(self, client_id: int, params: Params, result: TrainResult, pos: int,
                       state: Dict[str, Any], round_idx: int, products: Mapping[str, Any]) -> Message:
        """``products``: the payloads of ``client_products``, by ``ClientProduct.key``."""
        n = len(self.setup.client_indices[client_id])
        return Message(client_id, n, {"params": params},
                       {"steps": result.steps[pos], "train_loss": result.mean_loss[pos]})


def weighted_average(param_dicts: Sequence[Params], weights: Sequence[float]) -> Params:
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    w = w / w.sum()
    out = {}
    for name in param_dicts[0]:
        acc = torch.zeros_like(param_dicts[0][name], dtype=torch.float64)
        for wi, p in zip(w.tolist(), param_dicts):
            acc.add_(p[name].double(), alpha=wi)
        out[name] = acc.to(param_dicts[0][name].dtype)
    return out

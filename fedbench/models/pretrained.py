"""Pretrained initial weights: ``model.pretrained=<checkpoint>`` (FedFisher Table 3, notes/fedfisher.md §3.4).

FedFisher fine-tunes a BN-free ResNet-18 pretrained on 32x32 Tiny-ImageNet (``resnet_18_tiny_imagenet_40.pt``,
architecture "ResNet18_tiny" = fedbench's ``resnet18_tiny``). Its released code copies every checkpoint tensor
whose name matches into ``ResNet18_mod`` (= ``resnet18_mod``) and leaves the new ``final`` 200 -> n_c layer at its
fresh initialisation. The checkpoint is not distributed with the papers' code; ``scripts/pretrain_tiny_imagenet.py``
makes one (the recipe is not given: §5).

Rules, all checked before any training:
* the file must exist and be a ``torch.save``-d state dict (plain, or under a ``state_dict`` / ``model`` key;
  DataParallel ``module.`` prefixes are stripped);
* every checkpoint tensor must name a parameter of the model with the same shape (anything else means the wrong
  architecture, and a silent partial load would be a different experiment);
* model parameters the checkpoint lacks keep the run's seeded initialisation and are listed in the record.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Dict, List, Mapping

import torch
import torch.nn as nn

from fedbench.config.validate import check_checkpoint_path  # noqa: F401  (torch-free, re-exported)
from fedbench.errors import FedbenchError


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()




def read_state_dict(path: str | Path) -> Dict[str, torch.Tensor]:
    p = check_checkpoint_path(path)
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:   # truncated, not a torch file, pickled objects
        raise FedbenchError(f"model.pretrained: {p} is not a readable torch checkpoint ({type(e).__name__})") from None
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise FedbenchError(f"model.pretrained: {p} holds no state dict of tensors")
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in obj.items()}


def load_pretrained(model: nn.Module, path: str | Path) -> Dict[str, Any]:
    """Copy the checkpoint's tensors into ``model`` in place; returns what was loaded and what stayed fresh."""
    state = read_state_dict(path)
    params = dict(model.named_parameters())
    unknown = [k for k in state if k not in params]
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(params[k].shape)}" for k in state
             if k in params and tuple(state[k].shape) != tuple(params[k].shape)]
    if unknown or wrong:
        what = (f"tensors the model does not have: {', '.join(unknown[:3])}" if unknown
                else f"shape mismatches: {'; '.join(wrong[:3])}")
        raise FedbenchError(f"model.pretrained: {path} does not fit model {type(model).__name__} ({what}"
                            f"{' ...' if len(unknown or wrong) > 3 else ''})")
    with torch.no_grad():
        for k, v in state.items():
            params[k].copy_(v.to(dtype=params[k].dtype, device=params[k].device))
    loaded: List[str] = list(state)
    fresh = [k for k in params if k not in state]
    return {"path": str(path), "sha256": file_sha256(check_checkpoint_path(path)), "loaded": len(loaded),
            "fresh": fresh}

"""Batch tensor transforms on the training device: uint8 -> float (+ normalise), crop/flip augmentation.

``Augment`` reproduces torchvision's ``RandomCrop(H, padding=p)`` + ``RandomHorizontalFlip()``
on whole batches without a Python loop over images, with all randomness from one generator:

* ``per="sample"``: an independent crop offset and flip for every image (the standard choice);
* ``per="batch"``: one offset and one flip shared by the batch, which is what FedFisher's and
  FedBEns' released code does by applying torchvision transforms to batch tensors
  (FedFisher note §3.1).

Draw order (fixed, so runs are reproducible): crop offsets (rows, then columns) if
``crop_padding > 0``, then flips if ``flip``. Padding values act in the space of the tensor
passed in: after normalisation, ``zero`` pads with the data mean and ``fill`` needs the
normalised value of the wanted pixel.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from fedbench.errors import FedbenchError

PAD_MODES = ("zero", "reflect", "fill")
PER_MODES = ("sample", "batch")


def _stat(v, like: Tensor) -> Tensor:
    t = torch.as_tensor(v, dtype=torch.float32, device=like.device).reshape(-1)
    shape = [1] * like.dim()
    if like.dim() >= 2:
        shape[1] = t.numel()
    elif t.numel() != 1:
        raise FedbenchError(f"normalisation statistics of length {t.numel()} do not fit a 1-d tensor")
    return t.view(shape)


def to_float(x: Tensor, mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None) -> Tensor:
    """uint8 -> float32 in [0, 1]; then ``(x - mean) / std`` per channel (dim 1) if both are given.

    Float input is returned as float32 (normalised if mean/std are given); the input is never
    modified in place. Works on [N,C,H,W], [N,D] (per-feature statistics) or any [N,C,...].
    """
    if (mean is None) != (std is None):
        raise FedbenchError("to_float needs both mean and std, or neither")
    if x.dtype == torch.uint8:
        out = x.to(torch.float32).div_(255.0)
    elif x.is_floating_point():
        out = x.to(torch.float32)
    else:
        raise FedbenchError(f"to_float expects uint8 or floating-point input, got {x.dtype}")
    if mean is not None:
        m, s = _stat(mean, out), _stat(std, out)
        if out.dim() >= 2 and m.numel() not in (1, out.shape[1]):
            raise FedbenchError(f"{m.numel()} normalisation statistics for {out.shape[1]} channels")
        out = (out - m) / s
    return out


class Augment:
    """Random crop with padding + horizontal flip (p = 0.5) for float batches [B, C, H, W]."""

    def __init__(self, crop_padding: int = 0, pad_mode: str = "zero", fill: float = 0.0, flip: bool = False,
                 per: str = "sample"):
        if isinstance(crop_padding, bool) or not isinstance(crop_padding, int) or crop_padding < 0:
            raise FedbenchError(f"augment.crop_padding must be an integer >= 0, got {crop_padding!r}")
        if pad_mode not in PAD_MODES:
            raise FedbenchError(f"augment.pad_mode must be one of {', '.join(PAD_MODES)}, got {pad_mode!r}")
        if per not in PER_MODES:
            raise FedbenchError(f"augment.per must be one of {', '.join(PER_MODES)}, got {per!r}")
        if not isinstance(flip, bool):
            raise FedbenchError(f"augment.flip must be true or false, got {flip!r}")
        try:
            fill = float(fill)
        except (TypeError, ValueError):
            raise FedbenchError(f"augment.fill must be a number, got {fill!r}") from None
        self.crop_padding, self.pad_mode, self.fill, self.flip, self.per = crop_padding, pad_mode, fill, flip, per

    @property
    def enabled(self) -> bool:
        return self.crop_padding > 0 or self.flip

    def __repr__(self) -> str:
        return (f"Augment(crop_padding={self.crop_padding}, pad_mode={self.pad_mode!r}, fill={self.fill}, "
                f"flip={self.flip}, per={self.per!r})")

    def _pad(self, x: Tensor) -> Tensor:
        p = self.crop_padding
        if self.pad_mode == "reflect":
            if p >= x.shape[-1] or p >= x.shape[-2]:
                raise FedbenchError(f"augment: reflect padding {p} needs images larger than {p} pixels, "
                                    f"got {tuple(x.shape[-2:])}")
            return F.pad(x, (p, p, p, p), mode="reflect")
        return F.pad(x, (p, p, p, p), mode="constant", value=0.0 if self.pad_mode == "zero" else self.fill)

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        if x.dim() != 4:
            raise FedbenchError(f"augment expects a batch [B,C,H,W], got shape {tuple(x.shape)}")
        if not self.enabled or x.shape[0] == 0:
            return x
        b, _, h, w = x.shape
        n = b if self.per == "sample" else 1
        if self.crop_padding > 0:
            p = self.crop_padding
            off = torch.randint(0, 2 * p + 1, (2, n), generator=generator)   # on the generator's device (CPU)
            padded = self._pad(x)
            if self.per == "batch":
                i, j = int(off[0, 0]), int(off[1, 0])
                x = padded[:, :, i:i + h, j:j + w]
            else:
                off = off.to(x.device)
                rows = off[0][:, None] + torch.arange(h, device=x.device)          # [B, H]
                cols = off[1][:, None] + torch.arange(w, device=x.device)          # [B, W]
                bidx = torch.arange(b, device=x.device)[:, None, None]
                x = padded[bidx, :, rows[:, :, None], cols[:, None, :]]            # [B, H, W, C]
                x = x.permute(0, 3, 1, 2)
        if self.flip:
            flips = torch.rand(n, generator=generator) < 0.5
            if self.per == "batch":
                if bool(flips[0]):
                    x = x.flip(-1)
            else:
                x = torch.where(flips.to(x.device)[:, None, None, None], x.flip(-1), x)
        return x.contiguous()

"""Batch tensor transforms on the training device: uint8 -> float (+ normalise), crop/flip, AutoAugment, Cutout.

``Augment`` reproduces torchvision's ``RandomCrop(H, padding=p)`` + ``RandomHorizontalFlip()``
on whole batches without a Python loop over images, with all randomness from one generator:

* ``per="sample"``: an independent crop offset and flip for every image (the standard choice);
* ``per="batch"``: one offset and one flip shared by the batch, which is what FedFisher's and
  FedBEns' released code does by applying torchvision transforms to batch tensors
  (FedFisher note §3.1).

Optional, after crop/flip (FOLA's Table I order, fola.md §3.1), both off by default:

* ``autoaugment``: torchvision's ``transforms.v2.AutoAugment`` policy (``cifar10``, ``imagenet``,
  ``svhn``) on the batch as uint8 (x·255 rounded: exact for 8-bit images, which is what the engine
  passes), one sub-policy draw per image. torchvision draws from the *global* torch RNG, a variable
  number of times per image; here the same draws (sub-policy index, one uniform per operation against its
  probability, one uniform per operation for the sign of a signed magnitude) come from the given
  generator, a fixed count per image, and torchvision's own operation code is applied to the images
  sharing an (operation, magnitude), so runs replay exactly. ``autoaugment_fill``: pixel value (0-255)
  of the area uncovered by shear/translate/rotate: torchvision's 0, or 128 as in the DeepVoltaire
  CIFAR10Policy that FOLA used ([44]).
* ``cutout``: Cutout (DeVries & Taylor) with holes of side ``cutout`` (FOLA: 16): a centre drawn
  uniformly over the image per hole, the square around it clipped at the border and set to 0 (black,
  before normalisation, as FOLA's code multiplies by the mask before Normalize).

Draw order (fixed, so runs are reproducible): crop offsets (rows, then columns) if
``crop_padding > 0``, then flips if ``flip``, then AutoAugment (sub-policy indices, probability
uniforms [n, 2], sign uniforms [n, 2]), then Cutout centres (rows [n, holes], then columns). Padding
values act in the space of the tensor passed in: after normalisation, ``zero`` pads with the data mean
and ``fill`` needs the normalised value of the wanted pixel. ``per="batch"`` shares every draw across
the batch.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from fedbench.errors import FedbenchError

PAD_MODES = ("zero", "reflect", "fill")
PER_MODES = ("sample", "batch")
AUTOAUGMENT_POLICIES = ("cifar10", "imagenet", "svhn")


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


def _int_option(value, key: str, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise FedbenchError(f"augment.{key} must be an integer {rng}, got {value!r}")
    return value


class Augment:
    """Random crop with padding + horizontal flip (p = 0.5), then optionally AutoAugment and Cutout, for
    float batches [B, C, H, W] with values in [0, 1]."""

    def __init__(self, crop_padding: int = 0, pad_mode: str = "zero", fill: float = 0.0, flip: bool = False,
                 per: str = "sample", autoaugment: Optional[str] = None, autoaugment_fill: int = 0,
                 cutout: int = 0, cutout_holes: int = 1):
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
        if autoaugment in (None, "none"):
            autoaugment = None
        elif autoaugment not in AUTOAUGMENT_POLICIES:
            raise FedbenchError(f"augment.autoaugment must be none or one of {', '.join(AUTOAUGMENT_POLICIES)}, "
                                f"got {autoaugment!r}")
        self.autoaugment_fill = _int_option(autoaugment_fill, "autoaugment_fill", 0, 255)
        self.cutout = _int_option(cutout, "cutout", 0)
        self.cutout_holes = _int_option(cutout_holes, "cutout_holes", 1)
        self.crop_padding, self.pad_mode, self.fill, self.flip, self.per = crop_padding, pad_mode, fill, flip, per
        self.autoaugment = autoaugment
        self._aa = None
        if autoaugment is not None:
            from torchvision.transforms import v2
            self._aa = v2.AutoAugment(v2.AutoAugmentPolicy(autoaugment), fill=self.autoaugment_fill)

    @property
    def enabled(self) -> bool:
        return self.crop_padding > 0 or self.flip or self.autoaugment is not None or self.cutout > 0

    def __repr__(self) -> str:
        return (f"Augment(crop_padding={self.crop_padding}, pad_mode={self.pad_mode!r}, fill={self.fill}, "
                f"flip={self.flip}, per={self.per!r}, autoaugment={self.autoaugment!r}, "
                f"autoaugment_fill={self.autoaugment_fill}, cutout={self.cutout}, cutout_holes={self.cutout_holes})")

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
        if self._aa is not None:
            x = self._autoaugment(x, generator, n)
        if self.cutout > 0:
            x = self._cutout(x, generator, n)
        return x.contiguous()

    def _autoaugment(self, x: Tensor, generator: torch.Generator, n: int) -> Tensor:
        aa = self._aa
        policies = aa._policies
        b, _, h, w = x.shape
        pick = torch.randint(0, len(policies), (n,), generator=generator).tolist()
        apply_u = torch.rand(n, 2, generator=generator).tolist()
        sign_u = torch.rand(n, 2, generator=generator).tolist()
        if n == 1:   # per="batch": one draw for every image
            pick, apply_u, sign_u = pick * b, apply_u * b, sign_u * b
        img = x.mul(255.0).round_().clamp_(0, 255).to(torch.uint8)
        # many tiny ops on a few 32x32 images: intra-op threads only add synchronisation on CPU (measured
        # 930 ms vs 13 ms per 32-image batch with 2 threads vs 1 on a busy 2-core machine)
        threads = torch.get_num_threads()
        if img.device.type == "cpu" and threads > 1:
            torch.set_num_threads(1)
        try:
            self._apply_policies(img, policies, pick, apply_u, sign_u, h, w)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        return img.to(x.dtype).div_(255.0)

    def _apply_policies(self, img: Tensor, policies, pick, apply_u, sign_u, h: int, w: int) -> None:
        aa = self._aa
        b = img.shape[0]
        for stage in (0, 1):
            groups: dict = {}
            for i in range(b):
                op, prob, mag_idx = policies[pick[i]][stage]
                if not apply_u[i][stage] <= prob:   # torchvision: skip unless U <= p
                    continue
                mags_fn, signed = aa._AUGMENTATION_SPACE[op]
                mags = mags_fn(10, h, w)
                mag = 0.0 if mags is None else float(mags[mag_idx])
                if mags is not None and signed and sign_u[i][stage] <= 0.5:
                    mag = -mag
                groups.setdefault((op, mag), []).append(i)
            for (op, mag), rows in groups.items():
                ix = torch.tensor(rows, device=img.device)
                img[ix] = aa._apply_image_or_video_transform(img[ix], op, mag, interpolation=aa.interpolation,
                                                             fill=aa._fill)

    def _cutout(self, x: Tensor, generator: torch.Generator, n: int) -> Tensor:
        b, _, h, w = x.shape
        k, half = self.cutout_holes, self.cutout // 2
        cy = torch.randint(0, h, (n, k), generator=generator).to(x.device)
        cx = torch.randint(0, w, (n, k), generator=generator).to(x.device)
        rows, cols = torch.arange(h, device=x.device), torch.arange(w, device=x.device)
        in_r = (rows >= (cy - half).clamp(0, h)[..., None]) & (rows < (cy + half).clamp(0, h)[..., None])   # [n,k,H]
        in_c = (cols >= (cx - half).clamp(0, w)[..., None]) & (cols < (cx + half).clamp(0, w)[..., None])   # [n,k,W]
        hole = (in_r[..., :, None] & in_c[..., None, :]).any(1)                                             # [n,H,W]
        return x.masked_fill(hole[:, None].expand(b, -1, -1, -1), 0.0)

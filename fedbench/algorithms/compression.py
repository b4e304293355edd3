"""Uplink compression of FedFisher / Fisher Merge / RegMean (notes/fedfisher.md §1.6, App. C).

* Uniform quantisation with ``levels`` magnitude levels and one float32 max per tensor:
  ``Q(x) = max|x| · round(levels · x / max|x|) / levels`` (the paper's Q(x, s_q) with
  l_q = 2^(⌊32/s_q⌋−1) − 1, and the code's ``quantize(x, s)`` with levels = 2^s − 1).
  The signed codes lie in [−levels, levels] and are sent with ⌈log2(2·levels + 1)⌉ bits each:
  16 bits for levels = 32767 (s_q = 2 / the code's s = 15), 8 bits for 127 (the paper's s_q = 4),
  9 bits for 255 (the code's ``quantize(·, 8)``, which its own bit count also charges as 9 bits).
  Codes are stored as int8 / int16 when that is exactly the bit width, otherwise bit-packed into
  uint8, so ``Message.nbytes`` counts what is transmitted.
* Low-rank SVD of a square factor (K-FAC factor, Gram matrix): ``A ≈ Q(U_r) diag(Q(S_r)) Q(Vh_r)``,
  each of U, S, Vh quantised as a whole with one max (the code's ``compress_mat``).
* The code's one global rank (``compress_fisher_kfac`` / ``compress_regmean_gram``):
  r = ⌊2d / Σ_l (sides)⌋ where the sum runs over 2·side + 1 per factor (+1 per K-FAC layer pair);
  equivalently the rank that makes the factors cost 16d bits at 8 bits per value. The paper's
  budget reading for another bit width b is ⌊16d / (b · Σ)⌋ (``budget_rank``).

Encoded tensors are dicts of tensors plus plain Python metadata (shape, levels), which
``tensor_bytes`` does not count (the server knows the architecture).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Mapping

import torch
from torch import Tensor

from fedbench.errors import FedbenchError


def levels_for_bits(bits: int) -> int:
    """Magnitude levels of a sign + (bits − 1)-bit code: the paper's l_q = 2^(b−1) − 1."""
    return 2 ** (int(bits) - 1) - 1


def code_bits(levels: int) -> int:
    """Bits needed for one signed code in [−levels, levels]."""
    return max(1, math.ceil(math.log2(2 * int(levels) + 1)))


def quantize_values(x: Tensor, levels: int) -> Tensor:
    """Q(x): the dequantised values (what the server reconstructs); zero stays zero."""
    codes, scale = _codes(x, levels)
    return codes.to(x.dtype) * (scale.to(x.dtype) / levels)


def _codes(x: Tensor, levels: int):
    m = x.detach().abs().max() if x.numel() else x.new_zeros(())
    m32 = m.float()
    safe = torch.where(m32 > 0, m32, torch.ones_like(m32))
    codes = torch.round(levels * (x.float() / safe)).clamp_(-levels, levels).to(torch.int64)
    return codes, m32


def _pack(u: Tensor, bits: int) -> Tensor:
    """Unsigned ints < 2^bits -> little-endian bit stream in uint8."""
    shifts = torch.arange(bits, device=u.device, dtype=torch.int64)
    stream = ((u.reshape(-1, 1) >> shifts) & 1).reshape(-1).to(torch.uint8)
    pad = (-stream.numel()) % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = (2 ** torch.arange(8, device=u.device, dtype=torch.int64)).to(torch.uint8)
    return (stream.reshape(-1, 8) * weights).sum(1, dtype=torch.int64).to(torch.uint8)


def _unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    bit = ((packed.to(torch.int64).reshape(-1, 1) >> torch.arange(8, device=packed.device)) & 1).reshape(-1)
    bit = bit[: n * bits].reshape(n, bits)
    return (bit << torch.arange(bits, device=packed.device, dtype=torch.int64)).sum(1)


def encode(x: Tensor, levels: int) -> Dict[str, Any]:
    """Quantised representation of ``x`` as transmitted (codes + float32 max)."""
    codes, scale = _codes(x, levels)
    bits = code_bits(levels)
    if bits == 8:
        q = codes.to(torch.int8)
    elif bits == 16:
        q = codes.to(torch.int16)
    else:
        q = _pack((codes + levels).reshape(-1), bits)
    return {"q": q, "max": scale.reshape(()), "levels": int(levels), "shape": tuple(x.shape)}


def decode(enc: Mapping[str, Any], dtype: torch.dtype = torch.float32) -> Tensor:
    levels, shape = enc["levels"], tuple(enc["shape"])
    bits = code_bits(levels)
    q = enc["q"]
    if bits in (8, 16):
        codes = q.to(torch.int64)
    else:
        n = int(math.prod(shape)) if shape else 1
        codes = _unpack(q, bits, n) - levels
    return (codes.to(dtype) * (enc["max"].to(dtype) / levels)).reshape(shape)


def encode_lowrank(A: Tensor, rank: int, levels: int) -> Dict[str, Any]:
    """Top-``rank`` SVD of a matrix, U, S, Vh each quantised with one max (the code's compress_mat)."""
    U, S, Vh = torch.linalg.svd(A.double())
    r = max(1, min(int(rank), S.numel()))
    return {"U": encode(U[:, :r].to(A.dtype), levels), "S": encode(S[:r].to(A.dtype), levels),
            "Vh": encode(Vh[:r, :].to(A.dtype), levels)}


def decode_lowrank(enc: Mapping[str, Any], dtype: torch.dtype = torch.float32) -> Tensor:
    U, S, Vh = decode(enc["U"], dtype), decode(enc["S"], dtype), decode(enc["Vh"], dtype)
    return (U * S) @ Vh


def budget_rank(num_params: int, sides: Iterable[int], bits: int, *, budget_bits_per_param: int = 16) -> int:
    """One rank for every factor: the largest r with Σ_f (2·side_f + 1)·r·bits ≤ budget·d (U, Vh and
    S of every factor). At 8 bits this is the code's ⌊2d / r1⌋ (r1 = Σ_l (2 a_l + 2 g_l + 2) for
    K-FAC, Σ_l (2 b_l + 1) for RegMean's Grams); the per-factor rank is then min(side, r)."""
    r1 = sum(2 * int(s) + 1 for s in sides)
    if r1 <= 0:
        raise FedbenchError("low-rank compression needs at least one factor")
    return max(1, int(budget_bits_per_param * num_params // (bits * r1)))


def check_bits(name: str, value, allowed_max: int = 32) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= allowed_max:
        raise FedbenchError(f"algorithm.{name} must be an integer in [2, {allowed_max}], got {value!r}")
    return int(value)

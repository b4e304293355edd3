"""FOLA's Table I augmentation (fola.md §3.1): AutoAugment (torchvision's CIFAR-10 policy, one draw per image
from the engine's generator) and Cutout, added to fedbench's tensor ``Augment`` after crop/flip."""
import pytest
import torch
from torchvision.transforms import v2

import torchvision.transforms.v2._auto_augment as tv_aa
from fedbench.data.transforms import Augment
from fedbench.errors import FedbenchError


def _images(n=64, seed=0, h=32, w=32):
    """8-bit images as the engine passes them: uint8 / 255 in float32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g, dtype=torch.uint8).float().div_(255.0)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_defaults_unchanged_and_options_validated():
    a = Augment(crop_padding=4, flip=True)
    assert a.autoaugment is None and a.cutout == 0
    x = _images(8)
    # adding the new keys at their off values draws nothing extra: the stream of every other preset is unchanged
    b = Augment(crop_padding=4, flip=True, autoaugment="none", autoaugment_fill=0, cutout=0, cutout_holes=1)
    assert torch.equal(a(x, _gen(3)), b(x, _gen(3)))
    assert Augment(cutout=16).enabled and Augment(autoaugment="cifar10").enabled and not Augment().enabled
    for bad in ({"autoaugment": "cifar"}, {"cutout": -1}, {"cutout": 2.5}, {"cutout_holes": 0},
                {"autoaugment_fill": 300}, {"autoaugment_fill": True}):
        with pytest.raises(FedbenchError, match="augment"):
            Augment(**bad)


def test_cutout_zeroes_one_16x16_square_per_image_before_normalisation():
    x = _images(200, seed=1).clamp_min(1 / 255)          # no pixel is 0 before the cutout
    y = Augment(cutout=16)(x, _gen(4))
    assert y.shape == x.shape and y.dtype == x.dtype
    zero = (y == 0)
    assert torch.equal(zero[:, 0], zero[:, 1]) and torch.equal(zero[:, 0], zero[:, 2])   # all channels
    kept = ~zero
    assert torch.equal(y[kept], x[kept])                   # the rest is untouched
    areas = zero[:, 0].sum((1, 2))
    rows = zero[:, 0].any(2).sum(1)
    cols = zero[:, 0].any(1).sum(1)
    assert torch.equal(areas, rows * cols)                 # one axis-aligned rectangle per image
    assert int(areas.max()) == 16 * 16 and int(areas.min()) >= 8 * 8   # clipped only at the border
    assert float((areas == 256).float().mean()) > 0.2      # centres in [8, 24) on both axes: 1/4 of the images
    full = (rows == 16) & (cols == 16)
    assert torch.equal(areas[full], torch.full_like(areas[full], 256))


def test_cutout_holes_and_batch_mode():
    x = _images(16, seed=2).clamp_min(1 / 255)
    y = Augment(cutout=4, cutout_holes=3)(x, _gen(0))
    assert int((y[:, 0] == 0).sum((1, 2)).max()) <= 3 * 16 and int((y[:, 0] == 0).sum((1, 2)).min()) >= 4
    yb = Augment(cutout=16, per="batch")(x, _gen(0))
    masks = (yb[:, 0] == 0)
    assert all(torch.equal(masks[0], m) for m in masks)    # one draw shared by the batch


def test_autoaugment_is_deterministic_given_the_generator_and_not_the_global_rng():
    x = _images(48, seed=3)
    a = Augment(crop_padding=4, pad_mode="fill", fill=128 / 255, flip=True, autoaugment="cifar10",
                autoaugment_fill=128, cutout=16)
    torch.manual_seed(0)
    y1 = a(x, _gen(7))
    torch.manual_seed(123)                                  # the global RNG plays no part
    y2 = a(x, _gen(7))
    assert torch.equal(y1, y2)
    assert not torch.equal(y1, a(x, _gen(8)))
    assert y1.shape == x.shape and y1.dtype == torch.float32
    assert float(y1.min()) >= 0.0 and float(y1.max()) <= 1.0
    assert torch.equal(y1 * 255, (y1 * 255).round())        # still 8-bit values


def test_autoaugment_changes_some_images_and_keeps_others():
    x = _images(200, seed=4)
    y = Augment(autoaugment="cifar10")(x, _gen(5))
    changed = (y != x).flatten(1).any(1)
    # the CIFAR-10 policy leaves an image alone only if neither operation fires (or it is a no-op on it)
    assert 0.3 < float(changed.float().mean()) < 1.0
    assert torch.equal(y[~changed], x[~changed])


class _ScriptedTorch:
    """torch for torchvision's AutoAugment.forward, with rand/randint replaced by scripted draws."""

    def __init__(self, ints, floats):
        self.ints, self.floats = list(ints), list(floats)

    def randint(self, high, size):
        return torch.tensor(self.ints.pop(0))

    def rand(self, size):
        return torch.tensor(self.floats.pop(0))

    def __getattr__(self, name):
        return getattr(torch, name)


def test_autoaugment_equals_torchvision_forward_per_image(monkeypatch):
    """Each image gets exactly what torchvision's v2.AutoAugment gives it for the same draws."""
    x = _images(40, seed=5)
    aug = Augment(autoaugment="cifar10", autoaugment_fill=128)
    g = _gen(11)
    y = aug(x, g)
    g = _gen(11)                                            # replay the draws the batch used
    pick = torch.randint(0, 25, (40,), generator=g).tolist()
    apply_u = torch.rand(40, 2, generator=g).tolist()
    sign_u = torch.rand(40, 2, generator=g).tolist()
    ref = v2.AutoAugment(v2.AutoAugmentPolicy.CIFAR10, fill=128)
    policies = ref._policies
    for i in range(40):
        floats = []   # forward draws U for each operation, then a sign U only when it fires with a signed magnitude
        for stage in (0, 1):
            op, p, _ = policies[pick[i]][stage]
            floats.append(apply_u[i][stage])
            fires = apply_u[i][stage] <= p
            mags_fn, signed = ref._AUGMENTATION_SPACE[op]
            if fires and signed and mags_fn(10, 32, 32) is not None:
                floats.append(sign_u[i][stage])
        monkeypatch.setattr(tv_aa, "torch", _ScriptedTorch([pick[i]], floats))
        want = ref(torch.round(x[i] * 255).to(torch.uint8))
        monkeypatch.undo()
        assert torch.equal((y[i] * 255).round().to(torch.uint8), want), i


def test_engine_batches_replay_identically():
    """The engine and FOLA's replay call the transform with the same per-client generator: same batch."""
    from fedbench.train.engine import client_generator

    x = _images(32, seed=6)
    a = Augment(crop_padding=4, pad_mode="fill", fill=128 / 255, flip=True, autoaugment="cifar10",
                autoaugment_fill=128, cutout=16)
    assert torch.equal(a(x, client_generator(0, 1, 3)), a(x, client_generator(0, 1, 3)))


def test_autoaugment_restores_the_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        Augment(autoaugment="cifar10")(_images(8), _gen(0))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

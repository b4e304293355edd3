"""Data package: real MNIST/FMNIST/UCI files through the offline mirror, torchvision loaders on
stand-in files of the real layout, the synthetic sets, and the tensor transforms."""
from __future__ import annotations

import gzip
import io
import os
import pickle
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from fedbench.data import DATASETS, FedDataset, default_mirror, load_dataset
from fedbench.data import images as img_mod
from fedbench.data.images import SHAPES, STATS
from fedbench.data.tabular import shuffle_split
from fedbench.data.transforms import Augment, to_float
from fedbench.errors import DataError, FedbenchError

MIRROR = default_mirror()
CONF = Path(__file__).resolve().parents[1] / "conf" / "dataset"
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
needs_mirror = pytest.mark.skipif(MIRROR is None or not (MIRROR / "MNIST" / "raw").is_dir(),
                                  reason="no offline mirror with MNIST (set FEDBENCH_DATA_MIRROR)")
needs_uci = pytest.mark.skipif(MIRROR is None or not (MIRROR / "uci").is_dir(), reason="no offline mirror with uci/")


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------------------------
# Real MNIST / Fashion-MNIST through the mirror
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("data_root")


@pytest.fixture(scope="module")
def mnist(data_root):
    return load_dataset("mnist", data_root, mirror=MIRROR, download=False)


@needs_mirror
def test_mnist_from_mirror(mnist, data_root):
    d = mnist
    assert d.name == "mnist" and d.task == "classification" and d.num_classes == 10
    assert d.train_x.shape == (60_000, 1, 28, 28) and d.test_x.shape == (10_000, 1, 28, 28)
    assert d.train_x.dtype == torch.uint8 and d.test_x.dtype == torch.uint8
    assert d.train_y.dtype == torch.int64 and d.test_y.dtype == torch.int64
    assert torch.bincount(d.train_y).tolist() == MNIST_TRAIN_COUNTS
    assert d.test_y.bincount().sum() == 10_000 and d.input_shape == (1, 28, 28)
    assert (d.mean, d.std) == ((0.1307,), (0.3081,))
    assert d.train_groups is None and d.approximate is None
    # decompressed into torchvision's layout, no temporary files left, tensor cache written
    raw = data_root / "MNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(img_mod.IDX_SHA256["MNIST"])
    assert (data_root / "fedbench_cache" / "mnist.pt").is_file()
    # the pixels are MNIST's: mean intensity 0.1307 (the normalisation constant) over the train set
    assert abs(d.train_x.float().mean().item() / 255 - 0.1307) < 1e-3


@needs_mirror
def test_mnist_second_load_uses_cache(mnist, data_root):
    again = load_dataset("mnist", data_root, mirror=False, download=False)
    assert torch.equal(again.train_x, mnist.train_x) and torch.equal(again.test_y, mnist.test_y)


@needs_mirror
def test_fmnist_from_mirror(data_root):
    d = load_dataset("fashion_mnist", data_root, mirror=MIRROR, download=False)
    assert d.name == "fmnist" and d.train_x.shape == (60_000, 1, 28, 28) and d.test_x.shape == (10_000, 1, 28, 28)
    assert d.train_x.dtype == torch.uint8 and d.train_y.dtype == torch.int64
    assert d.train_y.bincount().tolist() == [6000] * 10 and d.test_y.bincount().tolist() == [1000] * 10
    assert (data_root / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").is_file()


@needs_mirror
def test_corrupt_file_in_root_is_rejected(mnist, data_root, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(data_root / "MNIST", root / "MNIST")
    labels = root / "MNIST" / "raw" / "train-labels-idx1-ubyte"
    with open(labels, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([(b[0] + 1) % 256]))
    with pytest.raises(DataError) as e:
        load_dataset("mnist", root, mirror=MIRROR, download=False)
    msg = one_line_error(e)
    assert "train-labels-idx1-ubyte" in msg and "SHA-256" in msg and "delete" in msg


@needs_mirror
def test_cache_is_invalidated_when_a_source_file_changes(mnist, data_root, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(data_root / "MNIST", root / "MNIST")            # copy2 keeps mtimes, so the
    shutil.copytree(data_root / "fedbench_cache", root / "fedbench_cache")  # copied cache is valid
    assert torch.equal(load_dataset("mnist", root, mirror=False, download=False).train_y, mnist.train_y)
    with open(root / "MNIST" / "raw" / "t10k-labels-idx1-ubyte", "r+b") as f:
        f.seek(9)
        f.write(b"\x0b")
    with pytest.raises(DataError):
        load_dataset("mnist", root, mirror=False, download=False)


@needs_mirror
@pytest.mark.parametrize("damage", ["wrong_content", "truncated_gzip"])
def test_corrupt_mirror_leaves_no_partial_file(tmp_path, damage):
    mirror = tmp_path / "mirror"
    raw = mirror / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for f in img_mod.IDX_SHA256["MNIST"]:
        os.symlink(MIRROR / "MNIST" / "raw" / (f + ".gz"), raw / (f + ".gz"))
    bad = raw / "train-labels-idx1-ubyte.gz"
    good = (MIRROR / "MNIST" / "raw" / "train-labels-idx1-ubyte.gz").read_bytes()
    bad.unlink()
    if damage == "wrong_content":
        content = bytearray(gzip.decompress(good))
        content[-1] ^= 1
        bad.write_bytes(gzip.compress(bytes(content)))
    else:
        bad.write_bytes(good[: len(good) // 2])
    root = tmp_path / "root"
    with pytest.raises(DataError) as e:
        load_dataset("mnist", root, mirror=mirror, download=False)
    assert "train-labels-idx1-ubyte.gz" in one_line_error(e)
    left = sorted(p.name for p in (root / "MNIST" / "raw").iterdir())
    assert left == ["train-images-idx3-ubyte"]   # verified before the bad file; no partial copy


@pytest.mark.parametrize("name", ["mnist", "fmnist", "cifar10", "cifar100", "svhn", "gtsrb", "cinic10",
                                  "cifar10_jpeg", "uci_credit", "flamby_heart"])
def test_missing_data_without_mirror_or_download(name, tmp_path):
    with pytest.raises(DataError) as e:
        load_dataset(name, tmp_path, mirror=False, download=False)
    msg = one_line_error(e)
    assert f"'{name}'" in msg and str(tmp_path) in msg and "FEDBENCH_DATA_MIRROR" in msg
    # nothing half-made is left behind
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_unknown_names_and_options():
    with pytest.raises(FedbenchError, match="unknown dataset 'imagenet22k'"):
        load_dataset("imagenet22k", "/nonexistent")
    with pytest.raises(FedbenchError, match="no option 'like'"):
        load_dataset("mnist", "/nonexistent", like="cifar10")
    with pytest.raises(FedbenchError, match="unknown like='tiny'"):
        load_dataset("synthetic", "/nonexistent", like="tiny")
    for name in ["mnist", "fmnist", "fashion_mnist", "cifar10", "svhn", "cifar100", "gtsrb", "cinic10",
                 "uci_credit", "flamby_heart", "fedfisher_synthetic", "cifar10_jpeg", "synthetic"]:
        assert name in DATASETS


def test_default_mirror_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDBENCH_DATA_MIRROR", str(tmp_path))
    assert default_mirror() == tmp_path
    monkeypatch.setenv("FEDBENCH_DATA_MIRROR", "")
    assert default_mirror() is None


# ------------------------------------------------------------------------------------------
# Tabular sets (FedLap note §3.1)
# ------------------------------------------------------------------------------------------
@needs_uci
def test_uci_credit(tmp_path):
    d = load_dataset("uci_credit", tmp_path, mirror=MIRROR, download=False)
    assert d.train_x.shape == (522, 46) and d.test_x.shape == (131, 46)
    assert d.train_x.dtype == torch.float32 and d.train_y.dtype == torch.int64
    assert d.num_classes == 2 and d.mean is None and d.std is None
    assert int(d.train_y.sum()) == 236 and int(d.test_y.sum()) == 60     # '+' = 1: 296 / 653 = 45.3%
    x = torch.cat([d.test_x, d.train_x]).double()
    assert torch.allclose(x[:, :6].mean(0), torch.zeros(6, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(x[:, :6].std(0, unbiased=False), torch.ones(6, dtype=torch.float64), atol=1e-5)
    assert torch.equal(x[:, 6:].sum(1), torch.full((653,), 9.0, dtype=torch.float64))  # 9 one-hot blocks
    other = load_dataset("uci_credit", tmp_path, mirror=MIRROR, download=False, test_fold=4)
    assert other.test_x.shape == (130, 46) and torch.equal(other.test_x, d.train_x[-130:])


@needs_uci
def test_uci_credit_positive_class_switch(tmp_path):
    """positive_class='-' is PVI's OrdinalEncoder coding ('+' < '-', so '-' = 1): same rows, labels flipped."""
    plus = load_dataset("uci_credit", tmp_path, mirror=MIRROR, download=False)
    minus = load_dataset("uci_credit", tmp_path, mirror=MIRROR, download=False, positive_class="-")
    assert torch.equal(plus.train_x, minus.train_x) and torch.equal(plus.test_x, minus.test_x)
    assert torch.equal(minus.train_y, 1 - plus.train_y) and int(minus.train_y.sum()) == 522 - 236
    with pytest.raises(FedbenchError, match="positive_class") as e:
        load_dataset("uci_credit", tmp_path, mirror=MIRROR, download=False, positive_class="yes")
    assert "\n" not in str(e.value)


@needs_uci
def test_uci_credit_raw_numeric_switch(tmp_path):
    """standardize=false keeps the six numeric columns raw (same rows, same one-hot block); the standardised columns are
    exactly (raw - mean) / population std over all 653 rows."""
    std = load_dataset("uci_credit", tmp_path, mirror=MIRROR, download=False)
    raw = load_dataset("uci_credit", tmp_path, mirror=MIRROR, download=False, standardize=False)
    assert torch.equal(std.train_y, raw.train_y) and torch.equal(std.train_x[:, 6:], raw.train_x[:, 6:])
    allraw = torch.cat([raw.test_x, raw.train_x])[:, :6].double()
    z = (allraw - allraw.mean(0)) / allraw.std(0, unbiased=False)
    assert torch.allclose(z.float(), torch.cat([std.test_x, std.train_x])[:, :6], atol=1e-5)
    assert float(allraw[:, 5].max()) == 100000.0     # A15, income: why a paper that skipped scaling would differ
    with pytest.raises(FedbenchError, match="standardize") as e:
        load_dataset("uci_credit", tmp_path, mirror=MIRROR, download=False, standardize="no")
    assert "\n" not in str(e.value)


@needs_uci
def test_uci_file_checksum(tmp_path):
    (tmp_path / "uci").mkdir()
    text = (MIRROR / "uci" / "crx.data").read_text()
    (tmp_path / "uci" / "crx.data").write_text(text.replace("+", "-", 1))
    with pytest.raises(DataError, match="SHA-256"):
        load_dataset("uci_credit", tmp_path, mirror=MIRROR, download=False)


@needs_uci
def test_flamby_heart(tmp_path):
    d = load_dataset("flamby_heart", tmp_path, mirror=MIRROR, download=False)
    assert d.train_x.shape == (486, 13) and d.test_x.shape == (254, 13) and d.num_classes == 2
    assert np.bincount(d.train_groups).tolist() == [199, 172, 30, 85]
    assert np.bincount(d.test_groups).tolist() == [104, 89, 16, 45]
    # positives per hospital follow from FLamby's exact (sklearn) split with seed 43
    assert [int(d.train_y[d.train_groups == c].sum()) for c in range(4)] == [91, 65, 30, 66]
    assert [int(d.test_y[d.test_groups == c].sum()) for c in range(4)] == [48, 33, 15, 35]
    for c in range(4):  # per-hospital standardisation with that hospital's train statistics
        xc = d.train_x[torch.as_tensor(d.train_groups == c)].double()
        keep = xc.std(0) > 0
        assert torch.allclose(xc.mean(0), torch.zeros(13, dtype=torch.float64), atol=1e-5)
        assert torch.allclose(xc.std(0)[keep], torch.ones(int(keep.sum()), dtype=torch.float64), atol=1e-5)
    raw = load_dataset("flamby_heart", tmp_path, mirror=MIRROR, download=False, standardize="none")
    assert raw.train_x[:, 0].min() >= 28 and set(raw.train_x[:, -5:].unique().tolist()) == {0.0, 1.0}
    pooled = load_dataset("flamby_heart", tmp_path, mirror=MIRROR, download=False, standardize="pooled")
    assert torch.allclose(pooled.train_x.double().mean(0), torch.zeros(13, dtype=torch.float64), atol=1e-5)
    # FLamby's per-hospital training sets with its pooled test set: each half as the mode it comes from
    mixed = load_dataset("flamby_heart", tmp_path, mirror=MIRROR, download=False,
                         standardize="center_train_pooled_test")
    assert torch.equal(mixed.train_x, d.train_x) and torch.equal(mixed.test_x, pooled.test_x)
    assert not torch.allclose(mixed.test_x, d.test_x)
    with pytest.raises(FedbenchError, match="standardize"):
        load_dataset("flamby_heart", tmp_path, mirror=MIRROR, standardize="global")


def test_shuffle_split_matches_sklearn():
    sk = pytest.importorskip("sklearn.model_selection")
    rng = np.random.RandomState(0)
    for trial in range(40):
        n = int(rng.randint(10, 300))
        y = (rng.rand(n) < rng.uniform(0.1, 0.9)).astype(int) if trial % 2 else rng.randint(0, 3, n)
        strat = y if (trial % 4 < 2 and np.bincount(y).min() >= 2) else None
        a, b = sk.train_test_split(np.arange(n), train_size=0.66, test_size=1 - 0.66, random_state=43,
                                   shuffle=True, stratify=strat)
        c, d = shuffle_split(n, 0.66, 43, strat)
        assert np.array_equal(a, c) and np.array_equal(b, d)


def test_shuffle_split_sizes():
    for n in (46, 130, 261, 303):
        tr, te = shuffle_split(n, 0.66, 43)
        assert len(te) == int(np.ceil(0.34 * n - 1e-9)) and len(tr) + len(te) == n
        assert sorted(np.concatenate([tr, te]).tolist()) == list(range(n))


# ------------------------------------------------------------------------------------------
# Generated sets
# ------------------------------------------------------------------------------------------
def test_fedfisher_synthetic():
    d = load_dataset("fedfisher_synthetic", "/nonexistent", num_clients=3, n_per_client=50, seed=1)
    assert d.task == "regression" and d.num_classes == 0 and d.mean is None
    assert d.train_x.shape == (150, 2) and d.train_y.shape == (150,) and d.test_x.shape == (150, 2)
    assert d.train_x.dtype == torch.float32 and d.train_y.dtype == torch.float32
    assert np.bincount(d.train_groups).tolist() == [50, 50, 50] and np.bincount(d.test_groups).tolist() == [50] * 3
    assert torch.allclose(d.train_x.norm(dim=1), torch.ones(150), atol=1e-6)
    teachers = []
    for c in range(3):  # noiseless linear teacher per client; the test set shares it
        x, y = d.train_x[torch.as_tensor(d.train_groups == c)].double(), d.train_y[torch.as_tensor(d.train_groups == c)].double()
        w = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
        assert torch.allclose(x @ w, y, atol=1e-5)
        xt, yt = (d.test_x[torch.as_tensor(d.test_groups == c)].double(),
                  d.test_y[torch.as_tensor(d.test_groups == c)].double())
        assert torch.allclose(xt @ w, yt, atol=1e-4)
        assert not torch.equal(xt, x)
        teachers.append(w)
    assert not torch.allclose(teachers[0], teachers[1])
    again = load_dataset("fedfisher_synthetic", "/nonexistent", num_clients=3, n_per_client=50, seed=1)
    other = load_dataset("fedfisher_synthetic", "/nonexistent", num_clients=3, n_per_client=50, seed=2)
    assert torch.equal(again.train_x, d.train_x) and not torch.equal(other.train_x, d.train_x)
    default = load_dataset("fedfisher_synthetic", "/nonexistent")
    assert default.train_x.shape == (200, 2) and np.bincount(default.train_groups).tolist() == [100, 100]


def test_synthetic_shapes_match_real_sets():
    assert SHAPES["mnist"] == SHAPES["fmnist"] == ((1, 28, 28), 10, 60_000, 10_000)
    assert SHAPES["cifar10"] == SHAPES["cifar10_jpeg"] == ((3, 32, 32), 10, 50_000, 10_000)
    assert SHAPES["cifar100"] == ((3, 32, 32), 100, 50_000, 10_000)
    assert SHAPES["svhn"] == ((3, 32, 32), 10, 73_257, 26_032)
    assert SHAPES["gtsrb"] == ((3, 32, 32), 43, 26_640, 12_630)
    assert SHAPES["cinic10"] == ((3, 32, 32), 10, 90_000, 90_000)
    for like, ((c, h, w), k, _, _) in SHAPES.items():
        d = load_dataset("synthetic", "/nonexistent", like=like, train_size=k * 2, test_size=k)
        assert d.train_x.shape == (2 * k, c, h, w) and d.test_x.shape == (k, c, h, w)
        assert d.train_x.dtype == torch.uint8 and d.train_y.dtype == torch.int64
        assert d.num_classes == k and d.train_y.bincount(minlength=k).tolist() == [2] * k
        assert (d.mean, d.std) == STATS[like]
    full = load_dataset("synthetic", "/nonexistent", like="mnist")
    assert len(full.train_x) == 60_000 and len(full.test_x) == 10_000


@needs_mirror
def test_synthetic_mnist_matches_real_mnist_shapes(mnist):
    s = load_dataset("synthetic", "/nonexistent", like="mnist", train_size=100, test_size=10)
    assert s.input_shape == mnist.input_shape and s.num_classes == mnist.num_classes
    assert s.train_x.dtype == mnist.train_x.dtype and s.train_y.dtype == mnist.train_y.dtype


def test_synthetic_is_learnable_and_seeded():
    d = load_dataset("synthetic", "/nonexistent", like="cifar10", train_size=3000, test_size=1000, seed=0)
    x, xt = d.train_x.float().flatten(1), d.test_x.float().flatten(1)
    centroids = torch.stack([x[d.train_y == k].mean(0) for k in range(10)])
    acc = (torch.cdist(xt, centroids).argmin(1) == d.test_y).float().mean().item()
    assert 0.5 < acc < 0.99      # far above chance (0.1), not trivially separable
    again = load_dataset("synthetic", "/nonexistent", like="cifar10", train_size=3000, test_size=1000, seed=0)
    other = load_dataset("synthetic", "/nonexistent", like="cifar10", train_size=3000, test_size=1000, seed=1)
    assert torch.equal(again.train_x, d.train_x) and torch.equal(again.test_y, d.test_y)
    assert not torch.equal(other.train_x, d.train_x)


def test_feddataset_to_and_shape():
    d = load_dataset("synthetic", "/nonexistent", like="mnist", train_size=20, test_size=10)
    moved = d.to("cpu")
    assert isinstance(moved, FedDataset) and moved.input_shape == (1, 28, 28) and moved.name == d.name
    assert "synthetic" in repr(d) and len(repr(d)) < 300


# ------------------------------------------------------------------------------------------
# torchvision / ImageFolder loaders on stand-in files of the real layout (real data cannot be
# downloaded here; torchvision's MD5 checks are bypassed for these fakes)
# ------------------------------------------------------------------------------------------
@pytest.fixture
def no_md5(monkeypatch):
    import torchvision.datasets.cifar as tv_cifar
    import torchvision.datasets.svhn as tv_svhn
    import torchvision.datasets.utils as tv_utils

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *a, **k: True)
    monkeypatch.setattr(tv_utils, "check_integrity", lambda *a, **k: True)
    monkeypatch.setattr(tv_svhn.SVHN, "_check_integrity", lambda self: True)


def _fake_cifar_archive(path: Path, n_per_batch=4, n_test=3, seed=0):
    rng = np.random.default_rng(seed)
    folder = path.parent / "build" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for name, n in [(f"data_batch_{i}", n_per_batch) for i in range(1, 6)] + [("test_batch", n_test)]:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, n).tolist()
        batches[name] = (data, labels)
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": list(img_mod.CIFAR10_CLASSES)}, f)
    with tarfile.open(path, "w:gz") as tf:
        tf.add(folder, arcname="cifar-10-batches-py")
    shutil.rmtree(path.parent / "build")
    return batches


def test_cifar10_loader_from_mirror_archive(tmp_path, no_md5):
    mirror = tmp_path / "mirror"
    (mirror / "CIFAR10").mkdir(parents=True)
    batches = _fake_cifar_archive(mirror / "CIFAR10" / "cifar-10-python.tar.gz")
    root = tmp_path / "root"
    d = load_dataset("cifar10", root, mirror=mirror, download=False)
    assert d.train_x.shape == (20, 3, 32, 32) and d.test_x.shape == (3, 3, 32, 32) and d.train_x.dtype == torch.uint8
    first = batches["data_batch_1"][0][0].reshape(3, 32, 32)      # CIFAR rows are channel-major
    assert np.array_equal(d.train_x[0].numpy(), first)
    assert d.train_y.tolist() == sum((batches[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    assert d.test_y.tolist() == batches["test_batch"][1] and d.train_y.dtype == torch.int64
    assert (root / "cifar-10-batches-py" / "data_batch_5").is_file()
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
    assert torch.equal(load_dataset("cifar10", root, mirror=False, download=False).train_x, d.train_x)


def test_svhn_loader(tmp_path, no_md5):
    import scipy.io

    rng = np.random.default_rng(0)
    root = tmp_path / "root"
    (root / "SVHN").mkdir(parents=True)
    mats = {}
    for split, n in (("train", 7), ("test", 5)):
        X = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        y = rng.integers(1, 11, (n, 1)).astype(np.uint8)  # SVHN labels 1..10, 10 = digit 0
        y[0, 0] = 10
        scipy.io.savemat(root / "SVHN" / f"{split}_32x32.mat", {"X": X, "y": y})
        mats[split] = (X, y)
    d = load_dataset("svhn", root, mirror=False, download=False)
    X, y = mats["train"]
    assert d.train_x.shape == (7, 3, 32, 32) and d.test_x.shape == (5, 3, 32, 32)
    assert np.array_equal(d.train_x[2].numpy(), X[:, :, :, 2].transpose(2, 0, 1))
    assert d.train_y[0] == 0 and d.train_y.tolist() == (y[:, 0] % 10).tolist()
    assert d.mean == (0.4377, 0.4438, 0.4728)


def test_cinic10_imagefolder_loader(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    root = tmp_path / "root"
    expected = {}
    for split in ("train", "test", "valid"):
        for c, cls in enumerate(img_mod.CIFAR10_CLASSES):
            (root / "CINIC-10" / split / cls).mkdir(parents=True)
            for k in range(2):
                a = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(a).save(root / "CINIC-10" / split / cls / f"img{k}.png")
                expected[(split, c, k)] = a
    d = load_dataset("cinic10", root, mirror=False, download=False)
    assert d.train_x.shape == (20, 3, 32, 32) and d.test_x.shape == (20, 3, 32, 32)
    assert d.train_y.tolist() == [c for c in range(10) for _ in range(2)]
    assert np.array_equal(d.test_x[5].numpy(), expected[("test", 2, 1)].transpose(2, 0, 1))
    assert d.mean == (0.4789, 0.4723, 0.4305)


def test_gtsrb_loader_resizes_to_32(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    base = tmp_path / "root" / "gtsrb"
    for c in range(43):
        (base / "GTSRB" / "Training" / f"{c:05d}").mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, (40 + c, 35, 3), dtype=np.uint8)).save(
            base / "GTSRB" / "Training" / f"{c:05d}" / "00000_00000.ppm")
    (base / "GTSRB" / "Final_Test" / "Images").mkdir(parents=True)
    rows = ["Filename;Width;Height;Roi.X1;Roi.Y1;Roi.X2;Roi.Y2;ClassId"]
    test_imgs = []
    for i, cls in enumerate([5, 42, 0]):
        a = rng.integers(0, 256, (50, 61, 3), dtype=np.uint8)
        Image.fromarray(a).save(base / "GTSRB" / "Final_Test" / "Images" / f"{i:05d}.ppm")
        rows.append(f"{i:05d}.ppm;61;50;5;5;55;45;{cls}")
        test_imgs.append(a)
    (base / "GT-final_test.csv").write_text("\n".join(rows) + "\n")
    d = load_dataset("gtsrb", tmp_path / "root", mirror=False, download=False)
    assert d.num_classes == 43 and d.train_x.shape == (43, 3, 32, 32) and d.test_x.shape == (3, 3, 32, 32)
    assert d.train_y.tolist() == list(range(43)) and d.test_y.tolist() == [5, 42, 0]
    ref = np.asarray(Image.fromarray(test_imgs[1]).resize((32, 32), Image.BILINEAR))
    assert np.abs(d.test_x[1].numpy().transpose(1, 2, 0).astype(int) - ref.astype(int)).max() <= 1
    assert d.mean == (0.5, 0.5, 0.5)


# ------------------------------------------------------------------------------------------
# cifar10_jpeg: ordering logic on a small fake archive (fast) and the real one (slow)
# ------------------------------------------------------------------------------------------
def _jpeg(color) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="JPEG", quality=100)
    return buf.getvalue()


def test_cifar10_jpeg_order_on_fake_archive(tmp_path, monkeypatch):
    folder = tmp_path / "mirror" / "CIFAR10-JPEG"
    folder.mkdir(parents=True)
    labels = np.array([3, 1, 3, 0, 1, 3, 9], dtype=np.uint8)
    np.save(folder / "train_labels_original_order.npy", labels)
    with tarfile.open(folder / "cifar10-jpeg-q75.tar.gz", "w:gz") as tf:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for c in set(labels.tolist()):
            for k in range(int((labels == c).sum())):   # colour encodes (class, occurrence)
                add(f"train/{img_mod.CIFAR10_CLASSES[c]}/{k:04d}.jpg", _jpeg((20 * c, 60 * k, 0)))
        for c, k in [(2, 0), (0, 0), (0, 1)]:
            add(f"test/{img_mod.CIFAR10_CLASSES[c]}/{k:04d}.jpg", _jpeg((20 * c, 60 * k, 200)))
    from fedbench.data.sources import sha256_file
    for f in list(img_mod.JPEG_SHA256):
        monkeypatch.setitem(img_mod.JPEG_SHA256, f, sha256_file(folder / f))
    monkeypatch.setattr(img_mod, "JPEG_N_TEST", 3)
    d = load_dataset("cifar10_jpeg", tmp_path / "root", mirror=tmp_path / "mirror", download=False)
    assert d.approximate and "CIFAR-10" in d.approximate and "approximate" in d.approximate
    assert d.train_y.tolist() == labels.tolist() and d.test_y.tolist() == [0, 0, 2]
    seen = {}
    for i, c in enumerate(labels.tolist()):
        k = seen.get(c, 0)
        seen[c] = k + 1
        r, g = d.train_x[i, 0].float().mean().item(), d.train_x[i, 1].float().mean().item()
        assert abs(r - 20 * c) < 4 and abs(g - 60 * k) < 4
    assert abs(d.test_x[1, 1].float().mean().item() - 60) < 4
    assert (tmp_path / "root" / "fedbench_cache" / "cifar10_jpeg.pt").is_file()


@pytest.mark.slow
@pytest.mark.skipif(MIRROR is None or not (MIRROR / "CIFAR10-JPEG").is_dir(), reason="no CIFAR10-JPEG mirror")
def test_cifar10_jpeg_real(tmp_path):
    d = load_dataset("cifar10_jpeg", tmp_path, mirror=MIRROR, download=False)
    assert d.train_x.shape == (50_000, 3, 32, 32) and d.test_x.shape == (10_000, 3, 32, 32)
    assert d.train_y.bincount().tolist() == [5000] * 10 and d.test_y.bincount().tolist() == [1000] * 10
    assert np.array_equal(d.train_y.numpy(), np.load(MIRROR / "CIFAR10-JPEG" / "train_labels_original_order.npy"))
    assert d.approximate and (d.mean, d.std) == STATS["cifar10"]
    # close to CIFAR-10's pixel statistics
    m = d.train_x.float().mean((0, 2, 3)) / 255
    assert torch.allclose(m, torch.tensor(STATS["cifar10"][0]), atol=0.01)
    again = load_dataset("cifar10_jpeg", tmp_path, mirror=MIRROR, download=False)
    assert torch.equal(again.train_x, d.train_x)


# ------------------------------------------------------------------------------------------
# Transforms
# ------------------------------------------------------------------------------------------
def test_to_float():
    x = torch.tensor([[[[0, 255], [51, 102]]], [[[255, 0], [0, 0]]]], dtype=torch.uint8)  # [2,1,2,2]
    f = to_float(x)
    assert f.dtype == torch.float32 and torch.equal(f, x.float() / 255)
    n = to_float(x, (0.5,), (0.25,))
    assert torch.allclose(n, (x.float() / 255 - 0.5) / 0.25)
    rgb = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8)
    m, s = (0.1, 0.2, 0.3), (0.5, 0.6, 0.7)
    out = to_float(rgb, m, s)
    for c in range(3):
        assert torch.allclose(out[:, c], (rgb[:, c].float() / 255 - m[c]) / s[c])
    fl = torch.randn(6, 4)
    assert torch.equal(to_float(fl), fl)
    fm = to_float(fl, [1.0, 2.0, 3.0, 4.0], [2.0] * 4)
    assert torch.allclose(fm, (fl - torch.tensor([1.0, 2, 3, 4])) / 2) and not torch.equal(fm, fl)
    with pytest.raises(FedbenchError):
        to_float(rgb, m, None)
    with pytest.raises(FedbenchError):
        to_float(rgb, (0.1, 0.2), (1.0, 1.0))


def _batch(b=16, c=3, h=8, w=8, seed=0):
    return torch.rand((b, c, h, w), generator=torch.Generator().manual_seed(seed))


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_augment_disabled_and_identity():
    x = _batch()
    a = Augment()
    assert not a.enabled and torch.equal(a(x, _gen()), x)
    assert torch.equal(Augment(crop_padding=0, pad_mode="reflect", per="batch")(x, _gen()), x)
    assert Augment(flip=True).enabled and Augment(crop_padding=2).enabled


def test_flip_is_exact_mirror():
    x = _batch(b=64)
    y = Augment(flip=True)(x, _gen(1))
    flipped = torch.tensor([torch.equal(y[i], x[i].flip(-1)) for i in range(64)])
    kept = torch.tensor([torch.equal(y[i], x[i]) for i in range(64)])
    assert bool((flipped | kept).all()) and 10 < int(flipped.sum()) < 54
    assert torch.equal(y[flipped][:, :, :, 0], x[flipped][:, :, :, -1])


def _pad_reference(x, p, mode, fill=0.0):
    """Padding built by hand (not with F.pad)."""
    b, c, h, w = x.shape
    if mode == "reflect":
        def idx(n):
            i = torch.arange(-p, n + p).abs()
            return torch.where(i > n - 1, 2 * (n - 1) - i, i)
        return x[:, :, idx(h)][:, :, :, idx(w)]
    out = torch.full((b, c, h + 2 * p, w + 2 * p), 0.0 if mode == "zero" else fill)
    out[:, :, p:p + h, p:p + w] = x
    return out


def _offsets(y, padded, p):
    """For every output image, the (i, j) window of the padded image it equals (or None)."""
    h, w = y.shape[-2:]
    found = []
    for b in range(len(y)):
        hit = [(i, j) for i in range(2 * p + 1) for j in range(2 * p + 1)
               if torch.equal(y[b], padded[b, :, i:i + h, j:j + w])]
        found.append(hit[0] if hit else None)
    return found


@pytest.mark.parametrize("mode,fill", [("zero", 0.0), ("reflect", 0.0), ("fill", 0.7)])
def test_crop_padding_values(mode, fill):
    x, p = _batch(b=32), 3
    y = Augment(crop_padding=p, pad_mode=mode, fill=fill)(x, _gen(2))
    assert y.shape == x.shape
    offs = _offsets(y, _pad_reference(x, p, mode, fill), p)
    assert all(o is not None for o in offs)
    assert len(set(offs)) > 5                       # per-sample offsets differ
    if mode != "reflect":                            # some padding pixels are visible and have the value
        corner = [b for b, (i, j) in enumerate(offs) if i == 0 and j == 0]
        for b in corner:
            assert torch.all(y[b, :, 0, :] == fill) and torch.all(y[b, :, :, 0] == fill)


def test_per_batch_shares_offset_and_flip():
    x, p = _batch(b=24), 4
    for seed in range(6):
        a = Augment(crop_padding=p, pad_mode="zero", flip=True, per="batch")
        y = a(x, _gen(seed))
        padded = _pad_reference(x, p, "zero")
        plain, flipped = _offsets(y, padded, p), _offsets(y.flip(-1), padded, p)
        offs = plain if plain[0] is not None else flipped
        assert all(o is not None for o in offs) and len(set(offs)) == 1


def test_augment_is_seeded():
    x = _batch(b=32)
    a = Augment(crop_padding=4, pad_mode="reflect", flip=True)
    assert torch.equal(a(x, _gen(5)), a(x, _gen(5)))
    assert not torch.equal(a(x, _gen(5)), a(x, _gen(6)))
    g = _gen(7)
    first, second = a(x, g), a(x, g)
    assert not torch.equal(first, second)


def test_augment_validation():
    for kw in [dict(crop_padding=-1), dict(crop_padding=1.5), dict(pad_mode="edge"), dict(per="client"),
               dict(fill="white"), dict(flip="yes")]:
        with pytest.raises(FedbenchError):
            Augment(**kw)
    with pytest.raises(FedbenchError, match="reflect"):
        Augment(crop_padding=8, pad_mode="reflect")(_batch(h=8, w=8), _gen())
    with pytest.raises(FedbenchError):
        Augment(flip=True)(torch.rand(3, 8, 8), _gen())


# ------------------------------------------------------------------------------------------
# conf/dataset/*.yaml
# ------------------------------------------------------------------------------------------
EXPECTED_CONFIGS = {"mnist", "fmnist", "cifar10", "svhn", "cifar100", "gtsrb", "cinic10", "uci_credit",
                    "flamby_heart", "fedfisher_synthetic", "cifar10_jpeg", "synthetic"}


def test_dataset_configs():
    import inspect

    files = {p.stem: p for p in CONF.glob("*.yaml")}
    assert EXPECTED_CONFIGS <= set(files)
    for stem, path in files.items():
        node = OmegaConf.load(path)
        cfg = OmegaConf.create({"seed": 3, "num_clients": 2, "dataset": node})
        d = OmegaConf.to_container(cfg, resolve=True)["dataset"]
        assert set(d) == {"name", "normalize", "augment", "kwargs"}, stem
        assert d["name"] in DATASETS and isinstance(d["normalize"], bool)
        Augment(**d["augment"])
        params = inspect.signature(DATASETS.get(d["name"])).parameters
        assert set(d["kwargs"]) <= {k for k, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY}
    for stem in ("cifar10", "cifar100", "cinic10", "cifar10_jpeg"):
        aug = OmegaConf.load(files[stem]).augment
        assert aug.crop_padding == 4 and aug.flip and aug.pad_mode == "zero"
    fed = OmegaConf.create({"seed": 3, "num_clients": 2, "dataset": OmegaConf.load(files["fedfisher_synthetic"])})
    assert fed.dataset.kwargs.seed == 3 and fed.dataset.kwargs.num_clients == 2
    syn = OmegaConf.load(files["synthetic"]).kwargs
    assert (syn.like, syn.train_size, syn.test_size) == ("cifar10", 2000, 500)

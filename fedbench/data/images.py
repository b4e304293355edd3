"""Image data sets through the real torchvision / ImageFolder loaders, kept as uint8 [N,C,H,W] tensors.

Sourcing order for every set: (1) the data root already holds it in torchvision's layout;
(2) an offline mirror holds it (copied or decompressed into the root, then verified);
(3) torchvision downloads it (``download=True``); (4) a one-line :class:`DataError`.
The decoded tensors are cached in ``<root>/fedbench_cache/<name>.pt`` so later loads take
about a second; the cache is rebuilt whenever its source files change (size / mtime).
"""
from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from fedbench.data.base import DATASETS, FedDataset
from fedbench.data.sources import (atomic_dir, check_sha256, copy_verified, load_cache, one_line,
                                   save_cache, signature)
from fedbench.errors import DataError

# ---------------------------------------------------------------------------------------------
# Facts about each set: normalisation statistics (reference notes: FedFisher §3.1, FedBEns §3.1)
# and the exact shapes / class counts / split sizes (used by the synthetic stand-in as well).
# ---------------------------------------------------------------------------------------------
CIFAR10_STATS = ((0.491, 0.482, 0.447), (0.247, 0.243, 0.262))
STATS: Dict[str, Tuple[tuple, tuple]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fmnist": ((0.1307,), (0.3081,)),          # the papers use MNIST's statistics for FMNIST too
    "cifar10": CIFAR10_STATS,
    "cifar10_jpeg": CIFAR10_STATS,
    "cifar100": CIFAR10_STATS,                 # FedFisher / FedBEns use CIFAR-10's statistics
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    "cinic10": ((0.4789, 0.4723, 0.4305), (0.2421, 0.2383, 0.2587)),
    "gtsrb": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}

#: name -> (input shape (C,H,W), number of classes, train size, test size)
SHAPES: Dict[str, Tuple[Tuple[int, int, int], int, int, int]] = {
    "mnist": ((1, 28, 28), 10, 60_000, 10_000),
    "fmnist": ((1, 28, 28), 10, 60_000, 10_000),
    "cifar10": ((3, 32, 32), 10, 50_000, 10_000),
    "cifar10_jpeg": ((3, 32, 32), 10, 50_000, 10_000),
    "cifar100": ((3, 32, 32), 100, 50_000, 10_000),
    "svhn": ((3, 32, 32), 10, 73_257, 26_032),
    "cinic10": ((3, 32, 32), 10, 90_000, 90_000),
    "gtsrb": ((3, 32, 32), 43, 26_640, 12_630),
}
IMAGE_SETS = tuple(SHAPES)

# SHA-256 of the decompressed IDX files (../shared/datasets/README.md).
IDX_SHA256 = {
    "MNIST": {
        "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
        "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
        "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
        "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    },
    "FashionMNIST": {
        "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
        "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
        "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
        "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
    },
}

# The lossy CIFAR-10 stand-in (../shared/datasets/CIFAR10-JPEG).
JPEG_DIR = "CIFAR10-JPEG"
JPEG_TAR = "cifar10-jpeg-q75.tar.gz"
JPEG_LABELS = "train_labels_original_order.npy"
JPEG_SHA256 = {
    JPEG_TAR: "70260124a4d2364bd32a0a222ddcd4197d2afa56725518368da092f67d4c29fe",
    JPEG_LABELS: "fad921ba16b0efeebb54393d1351545d1fe1a357f6f81324c821e3e11b956c70",
}
JPEG_N_TEST = 10_000
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
JPEG_WARNING = ("cifar10_jpeg is a LOSSY STAND-IN for CIFAR-10 (all 60,000 images re-encoded as JPEG q75 "
                "by a third party; mean abs. pixel error ~5.8/255; accuracies run ~2-3 points below real "
                "CIFAR-10): label every result from it as approximate and never report it as CIFAR-10")


def _missing(name: str, root: Path, where: str, mirror: Optional[Path], download: bool,
             hint: str, why: str = "") -> DataError:
    mir = f"mirror {mirror}" if mirror is not None else "no offline mirror"
    dl = why or ("download=False" if download else "no download available")
    return DataError(f"data set '{name}' not found (looked in {root / where}; {mir}; {dl}); "
                     f"place {hint} under {root} or set FEDBENCH_DATA_MIRROR to an offline copy")


def _dataset(name: str, payload: dict) -> FedDataset:
    (c, h, w), k, _, _ = SHAPES[name]
    mean, std = STATS[name]
    return FedDataset(name=name, train_x=payload["train_x"], train_y=payload["train_y"],
                      test_x=payload["test_x"], test_y=payload["test_y"], num_classes=k,
                      task="classification", mean=mean, std=std,
                      approximate=JPEG_WARNING if name == "cifar10_jpeg" else None)


def _check_tensors(name: str, payload: dict, where: Path) -> dict:
    (c, h, w), k, _, _ = SHAPES[name]
    for split in ("train", "test"):
        x, y = payload[f"{split}_x"], payload[f"{split}_y"]
        if x.dtype != torch.uint8 or tuple(x.shape[1:]) != (c, h, w) or len(x) != len(y):
            raise DataError(f"data set '{name}' in {where} has {split} images of shape {tuple(x.shape)} "
                            f"({x.dtype}), expected [N,{c},{h},{w}] uint8; delete it and load again")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= k):
            raise DataError(f"data set '{name}' in {where} has {split} labels outside 0..{k - 1}; "
                            f"delete it and load again")
        payload[f"{split}_y"] = y.long()
    return payload


# ---------------------------------------------------------------------------------------------
# MNIST / Fashion-MNIST: IDX files, gunzipped from the mirror with SHA-256 checks.
# ---------------------------------------------------------------------------------------------
def _idx_set(name: str, folder: str, tv_cls_name: str, root: Path, mirror: Optional[Path],
             download: bool) -> FedDataset:
    raw = root / folder / "raw"
    shas = IDX_SHA256[folder]
    paths = [raw / f for f in shas]
    fix = "delete it and load again to re-copy it from the mirror or re-download it"

    if all(p.exists() for p in paths):
        cached = load_cache(root, name, signature(paths))
        if cached is not None:
            return _dataset(name, cached)
    # torchvision only past the tensor cache: importing it costs ~1-2 s, a large part of a sweep worker's start-up
    import torchvision.datasets as tvd

    tv_cls = getattr(tvd, tv_cls_name)
    for f, sha in shas.items():
        dst = raw / f
        if dst.exists():
            check_sha256(dst, sha, f"data set '{name}'", fix)
            continue
        src = None
        if mirror is not None:
            for cand, gz in ((mirror / folder / "raw" / (f + ".gz"), True), (mirror / folder / "raw" / f, False)):
                if cand.exists():
                    src = (cand, gz)
                    break
        if src is not None:
            copy_verified(src[0], dst, sha, gunzip=src[1], what=f"data set '{name}'")
        elif download:
            try:
                for train in (True, False):
                    tv_cls(str(root), train=train, download=True)
            except Exception as e:
                raise _missing(name, root, f"{folder}/raw", mirror, download, f"the IDX files in {folder}/raw/",
                               why=f"download failed: {one_line(e)}") from None
            check_sha256(dst, sha, f"data set '{name}' (downloaded)", fix)
        else:
            raise _missing(name, root, f"{folder}/raw", mirror, download,
                           f"the four IDX files (or .gz) in {folder}/raw/")
    try:
        tr = tv_cls(str(root), train=True, download=False)
        te = tv_cls(str(root), train=False, download=False)
    except Exception as e:
        raise DataError(f"data set '{name}': torchvision cannot read {raw} ({one_line(e)}); "
                        f"delete the folder and load again") from None
    payload = {"train_x": tr.data.unsqueeze(1).contiguous(), "train_y": tr.targets.long(),
               "test_x": te.data.unsqueeze(1).contiguous(), "test_y": te.targets.long()}
    payload = _check_tensors(name, payload, raw)
    save_cache(root, name, signature(paths), **payload)
    return _dataset(name, payload)


@DATASETS.register("mnist")
def load_mnist(root: Path, mirror: Optional[Path], download: bool) -> FedDataset:
    """MNIST, 60,000/10,000 uint8 [N,1,28,28] (torchvision layout ``<root>/MNIST/raw``)."""
    return _idx_set("mnist", "MNIST", "MNIST", root, mirror, download)


@DATASETS.register("fmnist", "fashion_mnist")
def load_fmnist(root: Path, mirror: Optional[Path], download: bool) -> FedDataset:
    """Fashion-MNIST, 60,000/10,000 uint8 [N,1,28,28] (``<root>/FashionMNIST/raw``)."""
    return _idx_set("fmnist", "FashionMNIST", "FashionMNIST", root, mirror, download)


# ---------------------------------------------------------------------------------------------
# Other torchvision sets: copied / extracted from a mirror if it has them, else downloaded.
# torchvision's own integrity checks (MD5) run when the data set is constructed.
# ---------------------------------------------------------------------------------------------
def _suffixes(rel: str) -> List[str]:
    parts = Path(rel).parts
    return [str(Path(*parts[i:])) for i in range(len(parts))]


def _extract(archive: Path, dest: Path) -> None:
    from torchvision.datasets.utils import extract_archive
    try:
        extract_archive(str(archive), str(dest))
    except Exception as e:
        raise DataError(f"cannot extract {archive} ({one_line(e)}); the mirror copy is corrupt, "
                        f"replace it with a good copy") from None


def _provide(name: str, root: Path, mirror: Optional[Path], download: bool, *, targets: Sequence[str],
             archives: Dict[str, Optional[str]], download_fn: Optional[Callable[[], None]], hint: str) -> None:
    """Make every path in ``targets`` (relative to ``root``) exist, or raise a one-line DataError."""
    from torchvision.datasets.utils import check_integrity

    def missing() -> List[str]:
        return [t for t in targets if not (root / t).exists()]

    if not missing():
        return
    if mirror is not None and Path(mirror).is_dir():
        for t in missing():  # the mirror holds the same layout (folder or file)
            for cand in (mirror / t, mirror / Path(t).name):
                if cand.is_dir():
                    with atomic_dir(root / t) as tmp:
                        shutil.copytree(cand, tmp, dirs_exist_ok=True)
                    break
                if cand.is_file():
                    copy_verified(cand, root / t, None, what=f"data set '{name}'")
                    break
        if missing():  # the mirror holds torchvision's download archives
            found = []
            for a, md5 in archives.items():
                hits = [p for p in (mirror / a, *Path(mirror).glob(f"*/{a}")) if p.is_file()]
                if hits:
                    found.append((hits[0], md5))
            if found:
                work = root / f".{name}-extract"
                shutil.rmtree(work, ignore_errors=True)
                try:
                    for arc, md5 in found:
                        if md5 is not None and not check_integrity(str(arc), md5):
                            raise DataError(f"data set '{name}': {arc} fails its MD5 check; the mirror copy is "
                                            f"corrupt, replace it with a good copy")
                        _extract(arc, work)
                    for t in missing():
                        src = next((work / s for s in _suffixes(t) if (work / s).exists()), None)
                        if src is None:
                            continue
                        if src.is_dir():
                            with atomic_dir(root / t) as tmp:
                                tmp.rmdir()
                                shutil.move(str(src), str(tmp))
                        else:
                            copy_verified(src, root / t, None, what=f"data set '{name}'")
                finally:
                    shutil.rmtree(work, ignore_errors=True)
    if missing() and download and download_fn is not None:
        try:
            download_fn()
        except Exception as e:
            raise _missing(name, root, missing()[0], mirror, download, hint,
                           why=f"download failed: {one_line(e)}") from None
    if missing():
        raise _missing(name, root, missing()[0], mirror, download and download_fn is not None, hint)


def _construct(name: str, where: Path, make: Callable[[], object]):
    try:
        return make()
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"data set '{name}' in {where} cannot be read ({one_line(e)}); "
                        f"it is corrupt or incomplete: delete it and load again") from None


def _hwc_to_chw(a) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(a)).permute(0, 3, 1, 2).contiguous()


def _sig_files(paths: Sequence[Path]) -> list:
    """Fingerprint of folders (the folder itself and the files directly in it) and files."""
    out = []
    for p in map(Path, paths):
        out.append(p)
        if p.is_dir():
            out += sorted(q for q in p.iterdir() if q.is_file())
    return signature(out)


def _cifar(name: str, cls_name: str, root: Path, mirror, download) -> FedDataset:
    import torchvision.datasets as tvd

    cls = getattr(tvd, cls_name)
    folder = root / cls.base_folder
    if folder.is_dir():
        cached = load_cache(root, name, _sig_files([folder]))
        if cached is not None:
            return _dataset(name, cached)
    _provide(name, root, mirror, download, targets=[cls.base_folder], archives={cls.filename: cls.tgz_md5},
             download_fn=lambda: cls(str(root), train=True, download=True),
             hint=f"torchvision's {cls.base_folder}/ (or {cls.filename} in the mirror)")
    tr = _construct(name, folder, lambda: cls(str(root), train=True, download=False))
    te = _construct(name, folder, lambda: cls(str(root), train=False, download=False))
    payload = {"train_x": _hwc_to_chw(tr.data), "train_y": torch.as_tensor(tr.targets),
               "test_x": _hwc_to_chw(te.data), "test_y": torch.as_tensor(te.targets)}
    payload = _check_tensors(name, payload, folder)
    save_cache(root, name, _sig_files([folder]), **payload)
    return _dataset(name, payload)


@DATASETS.register("cifar10")
def load_cifar10(root: Path, mirror: Optional[Path], download: bool) -> FedDataset:
    """CIFAR-10, 50,000/10,000 uint8 [N,3,32,32] (``<root>/cifar-10-batches-py``)."""
    return _cifar("cifar10", "CIFAR10", root, mirror, download)


@DATASETS.register("cifar100")
def load_cifar100(root: Path, mirror: Optional[Path], download: bool) -> FedDataset:
    """CIFAR-100 (100 fine labels), 50,000/10,000 uint8 [N,3,32,32] (``<root>/cifar-100-python``)."""
    return _cifar("cifar100", "CIFAR100", root, mirror, download)


@DATASETS.register("svhn")
def load_svhn(root: Path, mirror: Optional[Path], download: bool) -> FedDataset:
    """SVHN ``train`` (73,257) and ``test`` (26,032) splits (``extra`` unused), ``<root>/SVHN/*.mat``."""
    import torchvision.datasets as tvd

    sroot = root / "SVHN"
    files = [tvd.SVHN.split_list[s][1] for s in ("train", "test")]
    if not all((sroot / f).exists() for f in files) and all((root / f).exists() for f in files):
        sroot = root  # torchvision's own layout puts the .mat files directly in the root
    paths = [sroot / f for f in files]
    if all(p.exists() for p in paths):
        cached = load_cache(root, "svhn", signature(paths))
        if cached is not None:
            return _dataset("svhn", cached)
    rel = sroot.relative_to(root)

    def dl():
        for s in ("train", "test"):
            tvd.SVHN(str(sroot), split=s, download=True)

    _provide("svhn", root, mirror, download, targets=[str(rel / f) for f in files], archives={},
             download_fn=dl, hint="train_32x32.mat and test_32x32.mat in SVHN/")
    tr = _construct("svhn", sroot, lambda: tvd.SVHN(str(sroot), split="train", download=False))
    te = _construct("svhn", sroot, lambda: tvd.SVHN(str(sroot), split="test", download=False))
    payload = {"train_x": torch.as_tensor(np.ascontiguousarray(tr.data)), "train_y": torch.as_tensor(tr.labels),
               "test_x": torch.as_tensor(np.ascontiguousarray(te.data)), "test_y": torch.as_tensor(te.labels)}
    payload = _check_tensors("svhn", payload, sroot)
    save_cache(root, "svhn", signature(paths), **payload)
    return _dataset("svhn", payload)


def _read_rgb(src) -> torch.Tensor:
    """Decode an image file (path or file object) with PIL as RGB -> uint8 [3, H, W]."""
    from PIL import Image

    with Image.open(src) as im:
        return torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)


def _stack_samples(name: str, samples: Sequence[Tuple[str, int]], load: Callable[[str], torch.Tensor],
                   where: Path) -> Tuple[torch.Tensor, torch.Tensor]:
    (c, h, w), _, _, _ = SHAPES[name]
    x = torch.empty((len(samples), c, h, w), dtype=torch.uint8)
    y = torch.empty(len(samples), dtype=torch.long)
    for i, (path, target) in enumerate(samples):
        try:
            img = load(path)
        except Exception as e:
            raise DataError(f"data set '{name}': cannot decode {path} ({one_line(e)}); "
                            f"replace the file or delete {where} and load again") from None
        if tuple(img.shape) != (c, h, w):
            raise DataError(f"data set '{name}': {path} has shape {tuple(img.shape)}, expected {(c, h, w)}; "
                            f"replace the file or delete {where} and load again")
        x[i] = img
        y[i] = target
    return x, y


@DATASETS.register("gtsrb")
def load_gtsrb(root: Path, mirror: Optional[Path], download: bool) -> FedDataset:
    """GTSRB (43 classes) via torchvision, resized once to 32x32 (bilinear, as ``Resize((32, 32))``)."""
    import torchvision.datasets as tvd
    from PIL import Image
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import pil_to_tensor, resize

    base = root / "gtsrb"
    targets = ["gtsrb/GTSRB/Training", "gtsrb/GTSRB/Final_Test/Images", "gtsrb/GT-final_test.csv"]
    if all((root / t).exists() for t in targets):
        cached = load_cache(root, "gtsrb", _sig_files([root / t for t in targets]))
        if cached is not None:
            return _dataset("gtsrb", cached)
    _provide("gtsrb", root, mirror, download, targets=targets,
             archives={"GTSRB-Training_fixed.zip": None, "GTSRB_Final_Test_Images.zip": None,
                       "GTSRB_Final_Test_GT.zip": None},
             download_fn=lambda: [tvd.GTSRB(str(root), split=s, download=True) for s in ("train", "test")],
             hint="torchvision's gtsrb/ folder (or its three zip files in the mirror)")

    def load(path: str) -> torch.Tensor:
        with Image.open(path) as im:
            return pil_to_tensor(resize(im.convert("RGB"), [32, 32], InterpolationMode.BILINEAR))

    payload = {}
    for split in ("train", "test"):
        ds = _construct("gtsrb", base, lambda: tvd.GTSRB(str(root), split=split, download=False))
        payload[f"{split}_x"], payload[f"{split}_y"] = _stack_samples("gtsrb", ds._samples, load, base)
    payload = _check_tensors("gtsrb", payload, base)
    save_cache(root, "gtsrb", _sig_files([root / t for t in targets]), **payload)
    return _dataset("gtsrb", payload)


@DATASETS.register("cinic10")
def load_cinic10(root: Path, mirror: Optional[Path], download: bool) -> FedDataset:
    """CINIC-10 ImageFolders ``<root>/CINIC-10/{train,test}`` (90,000 each; ``valid`` unused)."""
    from torchvision.datasets import ImageFolder

    targets = ["CINIC-10/train", "CINIC-10/test"]
    if all((root / t).is_dir() for t in targets):
        cached = load_cache(root, "cinic10", _sig_files([root / t for t in targets]))
        if cached is not None:
            return _dataset("cinic10", cached)
    _provide("cinic10", root, mirror, download, targets=targets, archives={"CINIC-10.tar.gz": None},
             download_fn=None, hint="CINIC-10/train and CINIC-10/test (ImageFolder layout)")
    payload = {}
    for split in ("train", "test"):
        where = root / "CINIC-10" / split
        ds = _construct("cinic10", where, lambda: ImageFolder(str(where)))
        if tuple(ds.classes) != CIFAR10_CLASSES:
            raise DataError(f"data set 'cinic10': {where} has class folders {ds.classes}, expected "
                            f"{list(CIFAR10_CLASSES)}; fix the folder layout")
        payload[f"{split}_x"], payload[f"{split}_y"] = _stack_samples(
            "cinic10", ds.samples, _read_rgb, where)
    payload = _check_tensors("cinic10", payload, root / "CINIC-10")
    save_cache(root, "cinic10", _sig_files([root / t for t in targets]), **payload)
    return _dataset("cinic10", payload)


# ---------------------------------------------------------------------------------------------
# cifar10_jpeg: the lossy offline stand-in, decoded once from the tarball and cached.
# ---------------------------------------------------------------------------------------------
@DATASETS.register("cifar10_jpeg")
def load_cifar10_jpeg(root: Path, mirror: Optional[Path], download: bool) -> FedDataset:
    """CIFAR-10 re-encoded as JPEG q75 (an APPROXIMATION; see ``approximate``), train in official order."""
    folder = None
    for cand in (root / JPEG_DIR, None if mirror is None else Path(mirror) / JPEG_DIR):
        if cand is not None and all((cand / f).is_file() for f in JPEG_SHA256):
            folder = cand
            break
    if folder is None:
        raise _missing("cifar10_jpeg", root, JPEG_DIR, mirror, download,
                       f"{JPEG_TAR} and {JPEG_LABELS} in {JPEG_DIR}/", why="no download exists for this set")
    files = [folder / f for f in JPEG_SHA256]
    sig = [(p.name, p.stat().st_size) for p in files]  # no mtime: the mirror may be re-mounted
    cached = load_cache(root, "cifar10_jpeg", sig)
    if cached is not None:
        return _dataset("cifar10_jpeg", cached)
    for f, sha in JPEG_SHA256.items():
        check_sha256(folder / f, sha, "data set 'cifar10_jpeg'", "replace it with a good copy")

    labels = np.load(folder / JPEG_LABELS)
    blobs: Dict[Tuple[str, int, int], bytes] = {}
    cls_idx = {c: i for i, c in enumerate(CIFAR10_CLASSES)}
    try:
        with tarfile.open(folder / JPEG_TAR, "r:gz") as tf:
            for m in tf:
                parts = Path(m.name).parts
                if not m.isfile() or len(parts) < 3 or not parts[-1].endswith(".jpg"):
                    continue
                split, cls, fname = parts[-3], parts[-2], parts[-1]
                if split in ("train", "test") and cls in cls_idx:
                    blobs[(split, cls_idx[cls], int(fname[:-4]))] = tf.extractfile(m).read()
    except (OSError, EOFError, tarfile.TarError, ValueError) as e:
        raise DataError(f"data set 'cifar10_jpeg': cannot read {folder / JPEG_TAR} ({one_line(e)}); "
                        f"replace it with a good copy") from None

    # train: the k-th occurrence of class c in the official order is train/<class c>/<k:04d>.jpg
    occurrence = np.zeros(len(labels), dtype=np.int64)
    seen = np.zeros(10, dtype=np.int64)
    for i, c in enumerate(labels):
        occurrence[i] = seen[c]
        seen[c] += 1
    train_keys = [("train", int(c), int(k)) for c, k in zip(labels, occurrence)]
    test_keys = sorted(k for k in blobs if k[0] == "test")
    n_train_tar = sum(1 for k in blobs if k[0] == "train")
    if n_train_tar != len(labels) or any(k not in blobs for k in train_keys) or len(test_keys) != JPEG_N_TEST:
        raise DataError(f"data set 'cifar10_jpeg': {folder / JPEG_TAR} does not match {JPEG_LABELS} "
                        f"({n_train_tar} train / {len(test_keys)} test JPEGs); replace both with good copies")

    def decode(keys) -> torch.Tensor:
        x = torch.empty((len(keys), 3, 32, 32), dtype=torch.uint8)
        for i, k in enumerate(keys):
            try:
                x[i] = _read_rgb(io.BytesIO(blobs[k]))
            except Exception as e:
                raise DataError(f"data set 'cifar10_jpeg': cannot decode {k[0]}/{CIFAR10_CLASSES[k[1]]}/"
                                f"{k[2]:04d}.jpg in {folder / JPEG_TAR} ({one_line(e)}); "
                                f"replace it with a good copy") from None
        return x

    payload = {"train_x": decode(train_keys), "train_y": torch.as_tensor(labels.astype(np.int64)),
               "test_x": decode(test_keys), "test_y": torch.tensor([k[1] for k in test_keys], dtype=torch.long)}
    payload = _check_tensors("cifar10_jpeg", payload, folder)
    save_cache(root, "cifar10_jpeg", sig, **payload)
    return _dataset("cifar10_jpeg", payload)

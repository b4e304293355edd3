"""Data sets as whole tensors, their offline sources, and tensor transforms.

``load_dataset(name, root)`` returns a :class:`FedDataset`; images stay uint8 [N,C,H,W] and are
turned into floats per batch on the training device (:mod:`fedbench.data.transforms`).
Registered names: see ``DATASETS.names()``.
"""
from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Optional, Union

from fedbench.data.base import DATASETS, FedDataset
from fedbench.errors import DataError, FedbenchError

# importing the loader modules registers them
from fedbench.data import images as _images  # noqa: E402,F401
from fedbench.data import synthetic as _synthetic  # noqa: E402,F401
from fedbench.data import tabular as _tabular  # noqa: E402,F401

__all__ = ["DATASETS", "FedDataset", "load_dataset", "default_mirror", "MIRROR_ENV"]

MIRROR_ENV = "FEDBENCH_DATA_MIRROR"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def default_mirror() -> Optional[Path]:
    """``$FEDBENCH_DATA_MIRROR`` (an empty value disables mirrors), else ``<repo>/../shared/datasets``
    if that folder exists, else None."""
    env = os.environ.get(MIRROR_ENV)
    if env is not None:
        return Path(env).expanduser() if env.strip() else None
    shared = _REPO_ROOT.parent / "shared" / "datasets"
    return shared if shared.is_dir() else None


def load_dataset(name: str, root: Union[str, os.PathLike], *, mirror: Union[None, bool, str, os.PathLike] = None,
                 download: bool = True, **kwargs) -> FedDataset:
    """Load data set ``name`` (a registry name) with its files under ``root``.

    ``mirror``: an offline copy to take missing files from; None = :func:`default_mirror`,
    False = no mirror. ``download``: let torchvision / the UCI archive fetch what is still missing.
    ``kwargs`` go to the loader (e.g. ``like=`` for ``synthetic``); unknown ones raise FedbenchError.
    """
    loader = DATASETS.get(name)
    params = inspect.signature(loader).parameters
    options = [p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY]
    bad = sorted(set(kwargs) - set(options))
    if bad:
        raise FedbenchError(f"data set '{name}' has no option {', '.join(repr(b) for b in bad)}; "
                            f"valid options: {', '.join(options) if options else '(none)'}")
    if mirror is None:
        mirror_path = default_mirror()
    elif mirror is False:
        mirror_path = None
    elif mirror is True:
        raise FedbenchError("mirror must be a folder, None (default mirror) or False (no mirror)")
    else:
        mirror_path = Path(mirror).expanduser()
    root = Path(root).expanduser()
    try:
        return loader(root, mirror_path, bool(download), **kwargs)
    except PermissionError as e:
        raise DataError(f"data set '{name}': cannot write to {e.filename or root} ({e.strerror}); "
                        f"choose a writable data root (paths.data_root or $FEDBENCH_DATA)") from None

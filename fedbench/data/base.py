"""The data-set record every loader returns, and the loader registry."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from fedbench.registry import Registry

#: name -> loader ``fn(root: Path, mirror: Path | None, download: bool, **kwargs) -> FedDataset``
DATASETS: Registry = Registry("dataset")

TASKS = ("classification", "regression")


@dataclass
class FedDataset:
    """A whole data set as tensors (images stay uint8 [N,C,H,W]; features float32 [N,D])."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int                      # 2 for binary tabular tasks, 0 for regression
    task: str                             # "classification" | "regression"
    mean: Optional[tuple] = None          # standard normalisation statistics (per channel) or None
    std: Optional[tuple] = None
    train_groups: Optional[np.ndarray] = None   # natural client id of each train sample
    test_groups: Optional[np.ndarray] = None
    approximate: Optional[str] = None     # non-None: a warning to print/record wherever the set is used

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if len(self.train_x) != len(self.train_y) or len(self.test_x) != len(self.test_y):
            raise ValueError(f"{self.name}: inputs and targets differ in length")
        for g, y in ((self.train_groups, self.train_y), (self.test_groups, self.test_y)):
            if g is not None and len(g) != len(y):
                raise ValueError(f"{self.name}: groups and targets differ in length")

    @property
    def input_shape(self) -> tuple:
        return tuple(self.train_x.shape[1:])

    def to(self, device) -> "FedDataset":
        """A copy with the four tensors on ``device`` (groups stay numpy arrays)."""
        return replace(self, train_x=self.train_x.to(device), train_y=self.train_y.to(device),
                       test_x=self.test_x.to(device), test_y=self.test_y.to(device))

    def __repr__(self) -> str:  # tensors would print thousands of numbers
        return (f"FedDataset(name={self.name!r}, train={tuple(self.train_x.shape)}:{self.train_x.dtype}, "
                f"test={tuple(self.test_x.shape)}, num_classes={self.num_classes}, task={self.task!r}"
                + (f", approximate={self.approximate!r}" if self.approximate else "") + ")")

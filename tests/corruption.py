"""Test helper: flip bytes inside the tensor data of a ``torch.save`` file (what a bad disk or a bad copy
does), leaving the zip and pickle structure intact so that ``torch.load`` still succeeds."""
from __future__ import annotations

import struct
import zipfile
from pathlib import Path


def tensor_data_span(path: Path) -> tuple:
    """(offset, size) of the largest tensor storage record in the file."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    assert info.compress_type == zipfile.ZIP_STORED
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def flip_tensor_bytes(path: Path, n: int = 64) -> None:
    """Invert ``n`` consecutive bytes in the middle of the largest tensor's data."""
    offset, size = tensor_data_span(path)
    n = min(n, size)
    start = offset + (size - n) // 2
    with open(path, "r+b") as f:
        f.seek(start)
        data = f.read(n)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))

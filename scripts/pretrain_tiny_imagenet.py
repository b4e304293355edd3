#!/usr/bin/env python
"""Pretrain FedFisher's BN-free ResNet-18 on 32x32 Tiny-ImageNet (the checkpoint of FedFisher Table 3).

    python scripts/pretrain_tiny_imagenet.py --data /path/to/tiny-imagenet-200 \\
        --out checkpoints/resnet_18_tiny_imagenet_40.pt            # 40 epochs, GPU if present

FedFisher's code loads ``resnet_18_tiny_imagenet_40.pt`` ("a ResNet18 model pre-trained on downsampled 32x32
TinyImageNet") into ResNet18_mod; the file is not distributed and its recipe is not given (notes/fedfisher.md §3.4,
§5). This script trains the checkpoint's architecture (``resnet18_tiny``: 7x7 stride-1 stem, BN-free stages,
fc 512->1000 -> linear 1000->200) with an inferred recipe, every value a flag: SGD lr 0.01, momentum 0.9, weight decay
5e-4, batch 128, 40 epochs ("40" in the file name), random crop (pad 4) + horizontal flip, images resized 64 -> 32
and normalised with fedbench's CIFAR-10 statistics (the fine-tuning data's). ``--data`` is the unpacked
``tiny-imagenet-200`` folder (``train/<wnid>/images/*.JPEG``; ``val/val_annotations.txt`` + ``val/images`` are used
for a per-epoch validation accuracy when present) or any ImageFolder-style ``train/<class>/...`` tree.

Writes the state dict (atomically) and ``<out>.json`` (recipe, class order, per-epoch loss and accuracy). Then
``python run.py experiment=fedfisher/table3 ...`` finds it at checkpoints/resnet_18_tiny_imagenet_40.pt (or pass
``model.pretrained=<path>``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fedbench.errors import FedbenchError  # noqa: E402

IMG_EXT = (".jpeg", ".jpg", ".png", ".bmp")


def _load_images(paths, size: int, desc: str, progress: bool) -> torch.Tensor:
    from PIL import Image
    from tqdm.auto import tqdm
    from torchvision.transforms import functional as TF

    out = torch.empty(len(paths), 3, size, size, dtype=torch.uint8)
    for i, p in enumerate(tqdm(paths, desc=desc, unit="img", disable=not progress, leave=False)):
        with Image.open(p) as im:
            im = im.convert("RGB")
            if im.size != (size, size):
                im = im.resize((size, size), Image.BILINEAR)
            out[i] = TF.pil_to_tensor(im)
    return out


def read_tiny_imagenet(root: Path, size: int = 32, max_per_class: int | None = None, progress: bool = True):
    """(train_x uint8 [N,3,s,s], train_y, classes, val_x or None, val_y or None)."""
    train_dir = root / "train"
    if not train_dir.is_dir():
        raise FedbenchError(f"--data {root}: no train/ folder (expected the unpacked tiny-imagenet-200 directory)")
    classes = sorted(d.name for d in train_dir.iterdir() if d.is_dir())
    if len(classes) < 2:
        raise FedbenchError(f"--data {root}: train/ has {len(classes)} class folder(s); need at least 2")
    paths, labels = [], []
    for c, name in enumerate(classes):
        files = sorted(p for p in (train_dir / name).rglob("*") if p.suffix.lower() in IMG_EXT)
        files = files[:max_per_class] if max_per_class else files
        paths += files
        labels += [c] * len(files)
    if not paths:
        raise FedbenchError(f"--data {root}: no images under train/")
    x = _load_images(paths, size, "train images", progress)
    y = torch.tensor(labels, dtype=torch.long)
    vx = vy = None
    ann = root / "val" / "val_annotations.txt"
    if ann.is_file():
        index = {n: i for i, n in enumerate(classes)}
        vpaths, vlabels = [], []
        for line in ann.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 2 and parts[1] in index and (root / "val" / "images" / parts[0]).is_file():
                vpaths.append(root / "val" / "images" / parts[0])
                vlabels.append(index[parts[1]])
        if vpaths:
            vx = _load_images(vpaths, size, "val images", progress)
            vy = torch.tensor(vlabels, dtype=torch.long)
    return x, y, classes, vx, vy


@torch.no_grad()
def accuracy(model, x, y, normalize, device, batch_size: int = 1024) -> float:
    model.eval()
    correct = 0
    for s in range(0, len(y), batch_size):
        xb = normalize(x[s:s + batch_size].to(device).float().div_(255.0))
        correct += int((model(xb).argmax(1).cpu() == y[s:s + batch_size]).sum())
    model.train()
    return 100.0 * correct / max(len(y), 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="tiny-imagenet-200 folder (train/<wnid>/images/*.JPEG)")
    ap.add_argument("--out", default="checkpoints/resnet_18_tiny_imagenet_40.pt")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--num-classes", type=int, default=200, help="head width (200 for Tiny-ImageNet)")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--max-per-class", type=int, default=None, help="use at most N training images per class")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from tqdm.auto import tqdm

    from fedbench.data.images import CIFAR10_STATS
    from fedbench.data.transforms import Augment
    from fedbench.models import build_model
    from fedbench.results.records import write_json_atomic

    for key in ("epochs", "batch_size", "num_classes"):
        if getattr(args, key) < 1:
            raise FedbenchError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.size != 32:
        raise FedbenchError("--size must be 32: resnet18_tiny/resnet18_mod take 3x32x32 inputs")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    out = Path(args.out)
    x, y, classes, vx, vy = read_tiny_imagenet(Path(args.data), args.size, args.max_per_class, not args.no_progress)
    if len(classes) > args.num_classes:
        raise FedbenchError(f"{len(classes)} classes found but --num-classes is {args.num_classes}")
    torch.manual_seed(args.seed)
    model = build_model("resnet18_tiny", input_shape=(3, args.size, args.size), num_classes=args.num_classes).to(device)
    mean = torch.tensor(CIFAR10_STATS[0], device=device).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STATS[1], device=device).view(1, 3, 1, 1)
    normalize = lambda t: (t - mean) / std   # noqa: E731
    aug = Augment(crop_padding=4, pad_mode="zero", flip=True, per="sample")
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    x_dev = x.to(device)
    log = []
    steps = (len(y) + args.batch_size - 1) // args.batch_size
    bar = tqdm(total=args.epochs * steps, desc="pretrain resnet18_tiny", unit="step", disable=args.no_progress)
    for ep in range(1, args.epochs + 1):
        t0, tot, n = time.perf_counter(), 0.0, 0
        for idx in torch.split(torch.randperm(len(y), generator=gen), args.batch_size):
            xb = aug(x_dev[idx.to(device)].float().div_(255.0), gen)
            loss = F.cross_entropy(model(normalize(xb)), y[idx].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += float(loss.detach()) * len(idx)
            n += len(idx)
            bar.update(1)
        row = {"epoch": ep, "train_loss": tot / n, "seconds": time.perf_counter() - t0}
        if vx is not None:
            row["val_accuracy"] = accuracy(model, vx, vy, normalize, device)
        bar.set_postfix({k: round(v, 3) for k, v in row.items() if k != "epoch"})
        log.append(row)
    bar.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, out)
    write_json_atomic(out.with_name(out.name + ".json"), {
        "architecture": "resnet18_tiny", "recipe": {k: v for k, v in vars(args).items() if k not in ("no_progress",)},
        "normalisation": {"mean": CIFAR10_STATS[0], "std": CIFAR10_STATS[1]}, "num_train": len(y),
        "classes": classes, "log": log})
    final = f", val accuracy {log[-1]['val_accuracy']:.2f}%" if "val_accuracy" in log[-1] else ""
    print(f"fedbench: pretrained resnet18_tiny on {len(y)} images ({len(classes)} classes), "
          f"{args.epochs} epochs{final} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

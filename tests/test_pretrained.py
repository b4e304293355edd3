"""Pretrained initial weights (FedFisher Table 3): loading by name, what stays fresh, bad checkpoints, the
pretraining script, and the client-stage cache keyed on the checkpoint's content."""
import json

import pytest
import torch

from fedbench.errors import FedbenchError
from fedbench.models import build_model
from fedbench.models.pretrained import file_sha256, load_pretrained
from tests.script_loader import load_script
from tests.test_run import SMALL, records, run


def _tiny(seed=1, num_classes=200):
    torch.manual_seed(seed)
    return build_model("resnet18_tiny", input_shape=(3, 32, 32), num_classes=num_classes)


def test_tiny_imagenet_checkpoint_loads_into_resnet18_mod_except_final(tmp_path, one_thread):
    src = _tiny()
    path = tmp_path / "ckpt.pt"
    torch.save(src.state_dict(), path)
    torch.manual_seed(7)
    dst = build_model("resnet18_mod", input_shape=(3, 32, 32), num_classes=10)
    final_before = dst.final.weight.detach().clone()
    info = load_pretrained(dst, path)
    assert info["fresh"] == ["final.weight"] and info["loaded"] == len(src.state_dict())
    assert info["sha256"] == file_sha256(path)
    for name, t in src.state_dict().items():
        assert torch.equal(dict(dst.named_parameters())[name], t), name
    assert torch.equal(dst.final.weight, final_before)
    # wrapped and DataParallel-prefixed checkpoints are the same weights
    torch.save({"state_dict": {f"module.{k}": v for k, v in src.state_dict().items()}}, tmp_path / "wrapped.pt")
    torch.manual_seed(8)
    dst2 = build_model("resnet18_mod", input_shape=(3, 32, 32), num_classes=10)
    load_pretrained(dst2, tmp_path / "wrapped.pt")
    assert torch.equal(dst2.conv1.weight, src.conv1.weight)


def test_bad_checkpoints_are_one_line_errors(tmp_path):
    model = build_model("lenet", input_shape=(1, 28, 28), num_classes=10)
    with pytest.raises(FedbenchError, match="no checkpoint at"):
        load_pretrained(model, tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(FedbenchError, match="not a readable torch checkpoint"):
        load_pretrained(model, tmp_path / "junk.pt")
    torch.save({"conv1.weight": torch.zeros(3)}, tmp_path / "shape.pt")
    with pytest.raises(FedbenchError, match="shape mismatches: conv1.weight"):
        load_pretrained(model, tmp_path / "shape.pt")
    torch.save({"layer9.weight": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(FedbenchError, match="does not have: layer9.weight"):
        load_pretrained(model, tmp_path / "other.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(FedbenchError, match="no state dict"):
        load_pretrained(model, tmp_path / "list.pt")
    # a 10-class resnet18_tiny head (linear 1000->10) does not fit resnet18_mod's linear 1000->200
    torch.save(_tiny(num_classes=10).state_dict(), tmp_path / "head.pt")
    with pytest.raises(FedbenchError, match="linear.weight"):
        load_pretrained(build_model("resnet18_mod", input_shape=(3, 32, 32), num_classes=10), tmp_path / "head.pt")


def _image_folder(root, classes=3, per_class=4, val=True):
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    lines = []
    for c in range(classes):
        d = root / "train" / f"n0{c}" / "images"
        d.mkdir(parents=True)
        for i in range(per_class):
            arr = torch.randint(0, 256, (64, 64, 3), generator=g, dtype=torch.uint8).numpy()
            Image.fromarray(arr).save(d / f"n0{c}_{i}.JPEG")
        if val:
            (root / "val" / "images").mkdir(parents=True, exist_ok=True)
            Image.fromarray(arr).save(root / "val" / "images" / f"val_{c}.JPEG")
            lines.append(f"val_{c}.JPEG\tn0{c}\t0\t0\t63\t63")
    if val:
        (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")


def test_pretraining_script_writes_a_loadable_checkpoint(tmp_path, one_thread):
    mod = load_script("pretrain_tiny_imagenet.py")
    _image_folder(tmp_path / "tiny")
    out = tmp_path / "ck" / "r.pt"
    assert mod.main(["--data", str(tmp_path / "tiny"), "--out", str(out), "--epochs", "1", "--batch-size", "6",
                     "--device", "cpu", "--no-progress"]) == 0
    meta = json.loads((tmp_path / "ck" / "r.pt.json").read_text())
    assert meta["num_train"] == 12 and meta["classes"] == ["n00", "n01", "n02"]
    assert len(meta["log"]) == 1 and 0 <= meta["log"][0]["val_accuracy"] <= 100
    info = load_pretrained(build_model("resnet18_mod", input_shape=(3, 32, 32), num_classes=10), out)
    assert info["fresh"] == ["final.weight"]
    assert mod.main(["--data", str(tmp_path / "nowhere"), "--out", str(out)]) == 2


def test_run_with_a_checkpoint_records_it_and_keys_the_cache_on_its_content(tmp_path, one_thread):
    torch.manual_seed(3)
    ck = tmp_path / "lenet.pt"
    lenet = build_model("lenet", input_shape=(1, 28, 28), num_classes=10)
    torch.save(lenet.state_dict(), ck)
    args = SMALL + ["rounds=1", f"+model.pretrained={ck}", "aggregators=[fedavg,fednova]"]
    run(args, tmp_path)
    recs = [json.loads(p.read_text()) for p in records(tmp_path)]
    assert len(recs) == 2
    for r in recs:
        assert r["model"]["pretrained"]["sha256"] == file_sha256(ck) and r["model"]["pretrained"]["fresh"] == []
    assert recs[0]["cache"]["misses"] + recs[1]["cache"]["misses"] == 1   # trained once, shared
    # same path, other content: the cached clients must not be reused
    torch.manual_seed(4)
    torch.save(build_model("lenet", input_shape=(1, 28, 28), num_classes=10).state_dict(), ck)
    run(args + ["force=true", "aggregators=[fedavg]"], tmp_path)
    rec = [json.loads(p.read_text()) for p in records(tmp_path) if json.loads(p.read_text())["algorithm"] == "fedavg"][0]
    assert rec["cache"]["misses"] == 1 and rec["model"]["pretrained"]["sha256"] == file_sha256(ck)
    p = run(SMALL + ["rounds=1", f"+model.pretrained={tmp_path / 'none.pt'}"], tmp_path, expect=2)
    assert "no checkpoint at" in p.stderr and len(p.stderr.strip().splitlines()) == 1

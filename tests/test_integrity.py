"""Cache integrity: bytes flipped inside a cached tensor (torch.load still succeeds) are caught by the
entry's SHA-256, reported in one line, and the entry is recomputed and rewritten valid."""
import torch

from fedbench.checksums import payload_sha256
from fedbench.data import load_dataset
from fedbench.data.sources import cache_path, load_cache
from fedbench.fl.cache import ClientStageCache, cache_key
from tests.corruption import flip_tensor_bytes
from tests.test_cache import _cached_setup, _run
from tests.test_data import _fake_cifar_archive, no_md5  # noqa: F401  (fixture)


def test_payload_sha256_sees_values_dtype_shape_and_structure():
    a = {"w": torch.arange(6.0).reshape(2, 3), "steps": [3, 4], "loss": 0.5}
    assert payload_sha256(a) == payload_sha256({"loss": 0.5, "steps": [3, 4], "w": torch.arange(6.0).reshape(2, 3)})
    assert payload_sha256(a) == payload_sha256({**a, "w": a["w"].t().contiguous().t()})  # strides
    flipped = a["w"].clone()
    flipped.view(-1).view(torch.uint8)[5] ^= 1   # one bit of one float
    for other in ({**a, "w": flipped}, {**a, "w": a["w"].reshape(3, 2)}, {**a, "w": a["w"].double()},
                  {**a, "steps": [3, 5]}, {**a, "loss": 0.25}, {**a, "extra": None}):
        assert payload_sha256(other) != payload_sha256(a)


def test_flipped_bytes_in_a_client_stage_entry(tmp_path, capsys):
    s = _cached_setup(tmp_path)
    clean, logs = _run(s, {"name": "fedavg"})
    assert s.cache.misses == 1
    (entry,) = (tmp_path / "cache").rglob("*.pt")
    good = torch.load(entry, weights_only=True)
    flip_tensor_bytes(entry, 64)
    # the damage is in the tensor data only: the file still loads, with other weights
    bad = torch.load(entry, weights_only=True)
    assert any(not torch.equal(g, b) for g, b in zip(_tensors(good["payload"]), _tensors(bad["payload"])))
    capsys.readouterr()
    again, logs = _run(s, {"name": "fedavg"})
    err = capsys.readouterr().err
    assert f"fedbench: WARNING: cache entry {entry} checksum mismatch; recomputing" in err.splitlines()
    assert s.cache.misses == 2 and s.cache.hits == 0 and not logs[0].cached_clients
    for n in clean["params"]:   # recomputed: exactly the clean result
        torch.testing.assert_close(again["params"][n], clean["params"][n], rtol=0, atol=0)
    rewritten = torch.load(entry, weights_only=True)   # rewritten valid: the clean weights, a matching checksum
    assert payload_sha256({k: v for k, v in rewritten.items() if k != "sha256"}) == rewritten["sha256"]
    assert payload_sha256(rewritten["payload"]["params"]) == payload_sha256(good["payload"]["params"])
    _run(s, {"name": "fedavg"})
    assert s.cache.hits == 1 and "WARNING" not in capsys.readouterr().err


def test_client_stage_entry_without_checksum_is_recomputed(tmp_path, capsys):
    cache = ClientStageCache(tmp_path)
    parts, calls = {"a": 1}, []
    compute = lambda: calls.append(1) or {"x": torch.ones(3)}  # noqa: E731
    cache.get_or_compute(parts, compute)
    path = cache.path(cache_key(parts))
    entry = torch.load(path, weights_only=True)
    del entry["sha256"]   # what fedbench wrote before checksums
    torch.save(entry, path)
    assert torch.equal(cache.get_or_compute(parts, compute)["x"], torch.ones(3)) and len(calls) == 2
    assert "has no checksum" in capsys.readouterr().err
    assert "sha256" in torch.load(path, weights_only=True)
    cache.get_or_compute(parts, compute)
    assert len(calls) == 2 and cache.hits == 1


def test_flipped_bytes_in_a_data_set_tensor_cache(tmp_path, no_md5, capsys):  # noqa: F811
    mirror = tmp_path / "mirror"
    (mirror / "CIFAR10").mkdir(parents=True)
    _fake_cifar_archive(mirror / "CIFAR10" / "cifar-10-python.tar.gz")
    root = tmp_path / "root"
    clean = load_dataset("cifar10", root, mirror=mirror, download=False)
    path = cache_path(root, "cifar10")
    good = torch.load(path, weights_only=True)
    flip_tensor_bytes(path, 64)
    bad = torch.load(path, weights_only=True)
    assert not torch.equal(bad["train_x"], good["train_x"])   # loads fine, wrong pixels
    capsys.readouterr()
    again = load_dataset("cifar10", root, mirror=False, download=False)
    assert f"fedbench: WARNING: cache entry {path} checksum mismatch; recomputing" in capsys.readouterr().err
    for k in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(again, k), getattr(clean, k))
    rewritten = load_cache(root, "cifar10", None)
    assert rewritten is not None and rewritten["sha256"] == good["sha256"]
    load_dataset("cifar10", root, mirror=False, download=False)
    assert "WARNING" not in capsys.readouterr().err


def test_data_set_cache_of_an_older_version_is_rebuilt(tmp_path):
    from fedbench.data import sources

    sources.save_cache(tmp_path, "toy", None, x=torch.arange(4))
    payload = torch.load(cache_path(tmp_path, "toy"), weights_only=True)
    assert load_cache(tmp_path, "toy", None) is not None
    torch.save({**{k: v for k, v in payload.items() if k != "sha256"}, "version": 1}, cache_path(tmp_path, "toy"))
    assert load_cache(tmp_path, "toy", None) is None


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []

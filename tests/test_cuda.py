"""GPU correctness (skipped without CUDA; CI has none — run on a GPU machine):
curvature on CUDA equals the CPU result, batched training on CUDA equals serial training on the CPU,
and a whole run goes through on CUDA."""
import json

import pytest
import torch

from fedbench.curvature import compute_curvature
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData, train_clients
from fedbench.train.stacked import CONV_STRATEGIES
from tests.test_engine import TinyCNN, _clients, _data, _start

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def no_tf32():
    """TF32 convolutions/matmuls would differ from the CPU at 1e-3; compare the exact arithmetic."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def _tensors(curv):
    if hasattr(curv, "diag"):
        return {n: t for n, t in curv.diag.items()}
    return {f"{n}.{f}": getattr(b, f) for n, b in curv.blocks.items() for f in ("A", "G")}


@pytest.mark.parametrize("structure, fisher, conv", [
    ("diag", "true", "expand"), ("diag", "empirical", "expand"), ("diag", "ggn", "expand"),
    ("kfac", "empirical", "fedlpa_kfc"), ("kfac", "true", "nngeometry"), ("kfac", "ggn", "expand"),
    ("kfac", "empirical", "reduce")])
def test_curvature_cuda_equals_cpu(structure, fisher, conv):
    torch.manual_seed(0)
    model = TinyCNN().double()
    data = _data(n=40)
    x, y = data.inputs(torch.arange(40)).double(), data.y
    cpu = compute_curvature(model, x, y, structure=structure, fisher=fisher, conv_convention=conv, batch_size=16)
    gpu = compute_curvature(model.cuda(), x.cuda(), y.cuda(), structure=structure, fisher=fisher,
                            conv_convention=conv, batch_size=16)
    assert gpu.meta["seconds"] > 0
    tc, tg = _tensors(cpu), _tensors(gpu)
    assert tc.keys() == tg.keys()
    for k in tc:
        assert tg[k].is_cuda
        torch.testing.assert_close(tg[k].cpu(), tc[k], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("strategy", CONV_STRATEGIES)
def test_batched_cuda_equals_serial_cpu(strategy):
    torch.manual_seed(0)
    model = TinyCNN()
    cfg = LocalTrainConfig(optimizer="sgd", lr=0.05, momentum=0.9, batch_size=8, epochs=2)
    data, clients = _data(), _clients()
    ser = train_clients(model, data, clients, _start(model), cfg, backend="serial", seed=3, round_idx=1)
    gdata = TrainData(data.x.cuda(), data.y.cuda(), mean=data.mean, std=data.std)
    gmodel = TinyCNN().cuda()
    gmodel.load_state_dict(model.state_dict())
    bat = train_clients(gmodel, gdata, [c.cuda() for c in clients], _start(gmodel), cfg, backend="batched",
                        conv_strategy=strategy, seed=3, round_idx=1)
    for ps, pb in zip(ser.params, bat.params):
        for n in ps:
            torch.testing.assert_close(pb[n].cpu(), ps[n], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algo", ["fedavg", "fedlap_cov", "fola"])
def test_run_on_cuda(tmp_path, algo):
    from tests.test_run import SMALL, records, run
    args = [a for a in SMALL if not a.startswith("hardware=")] + ["hardware=cuda", f"algorithm={algo}"]
    run(args, tmp_path)
    (rec_path,) = records(tmp_path)
    rec = json.loads(rec_path.read_text())
    assert rec["status"] == "ok" and rec["environment"]["device"].startswith("cuda")
    assert rec["environment"]["backend"] == "batched" and rec["metrics"]["accuracy"] > 0

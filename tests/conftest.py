"""Shared test fixtures."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny problems: intra-op threads only add contention on shared CPUs (restored after the module)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_and_seed():
    # Deterministic and gentle on a shared 2-core machine.
    torch.manual_seed(0)
    yield

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matmuls: with 2 threads on a busy machine each one waits on a spinning peer (~30 ms).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# The tests train tiny models: a second intra-op thread only adds synchronisation, and when the other core is busy
# (a DDP worker, another job) OpenMP's spin-waits make small ops 10-100x slower. One thread everywhere, DDP
# worker subprocesses included.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    # tests/test_cuda.py: CUDA-only tests (make gpu-check), skipped without a GPU
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (run with `make gpu-check`); skipped otherwise")

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
    return


# Diagnostics run strict in the tests: an internal error in a monitor raises instead of the one-time warning that
# turns the statistic off (a test that wants the lenient behaviour passes strict=False). Set in the environment, so
# that subprocesses (DDP workers, the console script) inherit it.
os.environ["LIGHTNING_MPT_STRICT_DIAGNOSTICS"] = "1"

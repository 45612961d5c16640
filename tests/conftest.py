import faulthandler
import sys

import pytest
import torch

# A deadlock must fail fast with every thread's stack, not hang CI (pytest-timeout also guards).
faulthandler.enable(file=sys.stderr, all_threads=True)


@pytest.fixture(autouse=True)
def _fresh_seed_and_threads():
    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    yield
    assert torch.get_num_threads() == threads, "a parsum call changed torch.get_num_threads()"

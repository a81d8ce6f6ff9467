"""Every test starts from the same global RNG state, so results do not depend on test order."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    # fresh inputs each run; the seed is printed on failure so a case can be replayed
    seed = np.random.SeedSequence().entropy % (1 << 32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)

import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")


@pytest.fixture
def rng(request):
    """A fresh, test-specific RNG (seeded from the test name, so failures reproduce)."""
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)

import os
import zlib

import numpy as np
import pytest

# 8 simulated CPU devices for the sharding tests (tests/test_sharding.py); every other test
# runs on device 0 as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()


@pytest.fixture
def rng(request):
    """A fresh, test-specific RNG (seeded from the test name, so failures reproduce: crc32,
    not hash(), which Python salts per process)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))

import os
import zlib

import numpy as np
import pytest

# 8 simulated CPU devices for the sharding tests (tests/library/test_sharding.py); every other test
# runs on device 0 as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()


@pytest.fixture
def rng(request):
    """A fresh, test-specific RNG (seeded from the test name, so failures reproduce: crc32,
    not hash(), which Python salts per process)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# Tests with a large transient footprint, in the order they run: the two with a > 2 GiB cache
# (64-bit page offsets), a decode step at M3's real vocabulary (128 × 200064 logits sorted for
# top-p), and the real SmolLM2 model's tests (torch and JAX copies of it). Measured peaks
# (2026-12-03): the real-model tests last 4.12 GB; first, then the 2 GiB caches after them,
# 3.93 GB; the 2 GiB caches first, then the real model, 2.85 GB.
_HEAVY = ("over_2gib", "at_real_vocab", "test_real_model.py::test_tokenizer_round_trip",
          "test_real_model.py::test_logits_match", "test_real_model.py::test_quick_study")


def _heavy_rank(item) -> int:
    return next((i for i, h in enumerate(_HEAVY) if h in item.nodeid), len(_HEAVY))


def pytest_collection_modifyitems(items):
    """The heavy tests run first, in _HEAVY's order, while the process is small: the suite's
    peak memory is then their footprint plus JAX, not plus what every earlier test left in
    JAX's caches (CI holds the tests under 4 GB)."""
    items.sort(key=_heavy_rank)


@pytest.fixture(autouse=True, scope="module")
def _release_jax_caches():
    """Compiled executables of one test file are not needed by the next: free them."""
    yield
    _release()


@pytest.fixture
def free_compiled():
    """For a file whose tests each compile models no other test reuses (``pytestmark =
    pytest.mark.usefixtures("free_compiled")``): free them after every test."""
    yield
    _release()


def _release():
    import gc

    import jax
    jax.clear_caches()
    gc.collect()
    _trim_heap()


def _trim_heap():
    """Returns the freed heap to the OS (glibc keeps it otherwise, and the next file's peak
    starts from this one's)."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):      # not glibc
        pass


_RSS_LOG = os.environ.get("M3SPARSE_RSS_LOG")   # a file: each test that raised the peak RSS


def pytest_runtest_teardown(item):
    """With M3SPARSE_RSS_LOG set, appends "peak_kb nodeid" whenever a test raised this
    process's peak resident set (CI keeps the tests under 4 GB: this says which test binds)."""
    if not _RSS_LOG:
        return
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if peak > getattr(pytest_runtest_teardown, "peak", 0):
        pytest_runtest_teardown.peak = peak
        with open(_RSS_LOG, "a") as f:
            f.write(f"{peak} {item.nodeid}\n")

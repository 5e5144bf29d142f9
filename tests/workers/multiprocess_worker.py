"""One of two processes (4 CPU devices each) running a TP=8 step over 8 global devices with
jax.distributed; checks its own shards against a one-device run. Usage: worker.py PORT ID."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid)

import sharding_case as sc  # noqa: E402


def main():
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    case = sc.make_case(np.random.default_rng(3), 8, 4, 64, layers=2)  # same data everywhere
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    text, cache, outs = sc.run_sharded(mesh, case)
    assert not sc.COLLECTIVE.search(text)
    want_cache, want_outs = sc.run_single(case, jax.local_devices()[0])
    for got, want in ((cache, want_cache), *zip(outs, want_outs)):
        want = np.asarray(want)
        for shard in got.addressable_shards:
            np.testing.assert_allclose(np.asarray(shard.data), want[shard.index],
                                       rtol=1e-5, atol=1e-6)
    print(f"OK process {pid}: {len(cache.addressable_shards)} local cache shards of "
          f"{cache.addressable_shards[0].data.shape}", flush=True)


main()
jax.distributed.shutdown()

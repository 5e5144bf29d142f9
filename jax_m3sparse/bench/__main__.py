"""``python -m jax_m3sparse.bench {peak,pack,decode,prefill,select,grouped,all} [--platform P] [--quick]``

Prints tables (speed is measured here, never in tests). ``peak`` measures the machine's
ceilings (multiply-add loops per instruction set on the CPU, copy and read bandwidth); ``all``
prints them first. ``--platform`` picks the JAX backend (cpu, cuda, rocm).

The gfx950 kernels' static report and their memory traffic counted on the ISA emulator need the
source checkout: ``python -m benchmarks.gfx950_static`` and ``python -m benchmarks.gfx950_traffic``
from the repository root (see BUILD.md).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m jax_m3sparse.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["peak", "pack", "decode", "prefill", "select", "grouped",
                                         "all"])
    parser.add_argument("--platform", default=None, help="JAX platform (default: JAX's default)")
    parser.add_argument("--quick", action="store_true", help="smallest shapes only (a smoke run)")
    args = parser.parse_args(argv)
    print(timed_path(args.platform, args.what), flush=True)
    if args.platform == "cuda":
        # CUDA: per-call device time amortized over many calls in one jit (bench/cuda.py);
        # it prints the decode, prefill and pack tables of BENCHMARKS.md together.
        from jax_m3sparse.bench import cuda  # noqa: PLC0415
        return cuda.main(["--quick"] if args.quick else [])
    import jax  # noqa: PLC0415

    from jax_m3sparse.bench import timing  # noqa: PLC0415
    device = jax.devices(args.platform)[0]
    todo = (["peak", "pack", "decode", "prefill", "select", "grouped"] if args.what == "all"
            else [args.what])
    for what in todo:
        getattr(timing, f"bench_{what}")(device, quick=args.quick)
        print()
    return 0


# The tables that time each CPU path (M3SPARSE_CPU_ISA) in rows of their own.
PER_PATH = ("peak", "decode", "prefill", "select", "all")


def timed_path(platform=None, what="all") -> str:
    """Which implementation "ours" is on ``platform``: the compiled module or the reference (and
    on the CPU, for the tables in PER_PATH, which paths they time)."""
    import jax  # noqa: PLC0415

    import jax_m3sparse as m3  # noqa: PLC0415
    platform = platform or jax.default_backend()
    if platform == "gpu":
        platform = "rocm" if "rocm" in jax.devices()[0].client.platform_version.lower() else "cuda"
    module, why = m3.native_module(platform)
    if why is None:
        line = f"timed path on {platform}: native module {module} (FFI custom calls)"
        if platform == "cpu" and what in PER_PATH:
            from jax_m3sparse.bench import timing  # noqa: PLC0415
            paths = timing.cpu_paths(jax.devices("cpu")[0])
            line += (f"; CPU paths timed: {', '.join(paths)} "
                     f"(a call takes {paths[-1]}; M3SPARSE_CPU_ISA caps it)")
        return line
    return (f"timed path on {platform}: THE PURE-JAX REFERENCE, no native module ({why}); "
            "'ours' below is the reference, not the kernels")


if __name__ == "__main__":
    sys.exit(main())

"""The gfx950 (ROCm backend) developer layer, shared by tests/rocm and benchmarks/.

* ``toolchain``: whether FlyDSL's export can run here, and the exported kernels' code objects,
  disassembly and resources;
* ``emu_launch``: runs exported code objects on tinygrad's CDNA emulator as ffi/rocm/handlers.cc
  launches them on a GPU; ``emu_fixes``: our fixes to that emulator; ``emu_traffic``: the bytes
  and MFMAs a run executes.

Import from the repository root (``from tools.rocm import emu_launch``); pytest has the root on
its path (pyproject.toml, ``pythonpath``).
"""

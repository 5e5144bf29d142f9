"""The native sources (CMake project). Python here: ``ffi.flydsl.elf_tools`` (import from the
repository root); the FlyDSL kernel modules are compiled by ``ffi/flydsl/export.py``, run as a script."""

"""The gfx950 kernels in FlyDSL and their ahead-of-time export.

``export.py`` (run as a script, by CMake and the tests) compiles the kernel modules, which import
each other by plain module name from this folder; ``elf_tools`` (no third-party imports) is
importable from the repository root as ``ffi.flydsl.elf_tools``.
"""

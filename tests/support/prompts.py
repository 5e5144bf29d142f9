"""Real text for the example's engine tests: the first bytes of licence files Debian ships
(a printable-ASCII filler where a file is missing)."""

from __future__ import annotations

import pathlib

LICENSES = pathlib.Path("/usr/share/common-licenses")


def license_prompts(lengths: dict[str, int], filler_repeat: int) -> list[list[int]]:
    """Byte tokens of each named licence file, cut to its length, in the given order; a
    missing file gives ``bytes(range(32, 127)) * filler_repeat`` cut the same way."""
    out = []
    for name, n in lengths.items():
        path = LICENSES / name
        data = path.read_bytes() if path.exists() else bytes(range(32, 127)) * filler_repeat
        out.append(list(data[:n]))
    return out

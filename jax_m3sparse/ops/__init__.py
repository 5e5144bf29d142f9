"""One file per primitive: pack, positions, decode, prefill (and the mixed batch)."""

"""Byte-level tokenizer (token = byte, vocabulary 256: nothing to download) and prompts."""

from __future__ import annotations

import os

# Real text every Debian machine has, truncated to varied lengths (tokens = bytes) so that
# prefill spans many 128-token blocks and prompts past 16 blocks (2048 tokens) make the
# indexer really skip blocks.
DEFAULT_PROMPTS = (
    ("/usr/share/common-licenses/BSD", 300),
    ("/usr/share/common-licenses/Artistic", 900),
    ("/usr/share/common-licenses/Apache-2.0", 1500),
    ("/usr/share/common-licenses/GPL-3", 2800),      # 22 blocks: top-16 skips up to 6
    ("/usr/share/common-licenses/MPL-2.0", 600),     # waits for a free slot and freed pages
)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def printable(tokens, limit: int = 72) -> str:
    """One console line: valid UTF-8 as text, other bytes and controls as escapes, cut."""
    s = bytes(int(t) for t in tokens).decode("utf-8", errors="backslashreplace")
    s = "".join(c if c.isprintable() or c == "\\" else repr(c)[1:-1] for c in s)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def load_prompts(files=None, max_tokens=None) -> list[tuple[str, list[int]]]:
    """(name, tokens) per prompt: ``files`` whole (cut to ``max_tokens``), else the defaults."""
    if files:
        specs = [(f, max_tokens) for f in files]
    else:
        specs = [(f, n if max_tokens is None else min(n, max_tokens)) for f, n in DEFAULT_PROMPTS]
    prompts = []
    for path, n in specs:
        with open(path, "rb") as fh:
            data = fh.read()
        tokens = list(data[:n] if n else data)
        prompts.append((os.path.basename(path), tokens))
    return prompts

"""Tokenizers (a checkpoint's ``tokenizer.json`` through ``tokenizers``, else bytes) and prompts."""

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


class ByteTokenizer:
    """Token = byte (vocabulary 256): what the random-weight model and a checkpoint without
    ``tokenizer.json`` use."""

    name = "bytes (no tokenizer.json)"

    def encode(self, data: bytes) -> list[int]:
        return list(data)

    def printable(self, tokens, limit: int = 72) -> str:
        return printable(tokens, limit)


class HFTokenizer:
    """A checkpoint directory's ``tokenizer.json`` (Hugging Face ``tokenizers``)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer  # noqa: PLC0415 (optional dependency)
        self.tok = Tokenizer.from_file(path)
        self.name = f"{path} ({self.tok.get_vocab_size()} tokens)"

    def encode(self, data: bytes) -> list[int]:
        return self.tok.encode(data.decode("utf-8", errors="replace"),
                               add_special_tokens=False).ids

    def printable(self, tokens, limit: int = 72) -> str:
        s = self.tok.decode([int(t) for t in tokens])
        s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
        return s if len(s) <= limit else s[:limit - 3] + "..."


def tokenizer_for(checkpoint: str | None):
    """The checkpoint directory's tokenizer.json when there is one, else bytes."""
    path = checkpoint and os.path.join(checkpoint, "tokenizer.json")
    return HFTokenizer(path) if path and os.path.exists(path) else ByteTokenizer()


def printable(tokens, limit: int = 72) -> str:
    """One console line: valid UTF-8 as text, other bytes and controls as escapes, cut."""
    s = bytes(int(t) for t in tokens).decode("utf-8", errors="backslashreplace")
    s = "".join(c if c.isprintable() or c == "\\" else repr(c)[1:-1] for c in s)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def load_prompts(files=None, max_tokens=None, tokenizer=None) -> list[tuple[str, list[int]]]:
    """(name, tokens) per prompt: ``files`` whole (cut to ``max_tokens`` tokens), else the
    defaults, each cut to its token count."""
    tokenizer = tokenizer or ByteTokenizer()
    if files:
        specs = [(f, max_tokens) for f in files]
    else:
        specs = [(f, n if max_tokens is None else min(n, max_tokens)) for f, n in DEFAULT_PROMPTS]
    prompts = []
    for path, n in specs:
        with open(path, "rb") as fh:
            data = fh.read()
        tokens = tokenizer.encode(data)
        prompts.append((os.path.basename(path), tokens[:n] if n else tokens))
    return prompts

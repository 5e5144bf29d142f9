"""Tokenizers (a checkpoint's ``tokenizer.json`` through ``tokenizers``, else bytes) and prompts."""

from __future__ import annotations

import json
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
    """Byte tokens as text; an id past 255 (a checkpoint's vocabulary without its
    tokenizer.json) as ``<id>``."""
    return "".join(run.decode("utf-8", errors="replace") if isinstance(run, bytes) else run
                   for run in _byte_runs(tokens))


def _byte_runs(tokens) -> list:
    """``tokens`` as runs of byte tokens (bytes) between ids past 255 (``"<id>"``)."""
    runs, run = [], []
    for t in map(int, tokens):
        if 0 <= t < 256:
            run.append(t)
            continue
        runs += [bytes(run)] if run else []
        runs.append(f"<{t}>")
        run = []
    return runs + ([bytes(run)] if run else [])


class ByteTokenizer:
    """Token = byte (vocabulary 256): what the random-weight model and a checkpoint without
    ``tokenizer.json`` use."""

    name = "bytes (no tokenizer.json)"

    def encode(self, data: bytes) -> list[int]:
        return list(data)

    def eos_token_ids(self) -> list[int]:
        return []                  # every byte is text

    def printable(self, tokens, limit: int = 72) -> str:
        return printable(tokens, limit)


class HFTokenizer:
    """A checkpoint directory's ``tokenizer.json`` (Hugging Face ``tokenizers``)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer  # noqa: PLC0415 (optional dependency)
        self.tok = Tokenizer.from_file(path)
        self.path = path
        self.name = f"{path} ({self.tok.get_vocab_size()} tokens)"

    def eos_token_ids(self) -> list[int]:
        """The id of ``eos_token`` in the ``tokenizer_config.json`` beside ``tokenizer.json``
        (a string or ``{"content": ...}``), if both exist."""
        cfg = _read_json(os.path.join(os.path.dirname(self.path), "tokenizer_config.json"))
        eos = cfg.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        i = self.tok.token_to_id(eos) if isinstance(eos, str) else None
        return [] if i is None else [i]

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


def eos_token_ids(source: str | None, tokenizer) -> list[int]:
    """EOS ids of a model: ``eos_token_id`` (an int or a list) of ``config.json`` (top level and
    ``text_config``) and ``generation_config.json`` in ``source`` (a checkpoint directory, or a
    config.json file and its directory), and the tokenizer's; sorted, no duplicates."""
    ids = set(tokenizer.eos_token_ids())
    if source:
        folder = source if os.path.isdir(source) else os.path.dirname(source)
        config = source if os.path.isfile(source) else os.path.join(folder, "config.json")
        for path in (config, os.path.join(folder, "generation_config.json")):
            cfg = _read_json(path)
            for c in (cfg, cfg.get("text_config") or {}):
                v = c.get("eos_token_id")
                ids.update([v] if isinstance(v, int) else v or [])
    return sorted(int(i) for i in ids)


def _read_json(path: str) -> dict:
    """A JSON object file's contents; {} when it does not exist."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def printable(tokens, limit: int = 72) -> str:
    """One console line: valid UTF-8 as text, other bytes and controls as escapes, ids past
    255 as ``<id>``, cut."""
    pieces = []
    for run in _byte_runs(tokens):
        if isinstance(run, str):
            pieces.append(run)
            continue
        s = run.decode("utf-8", errors="surrogateescape")
        pieces += [c if c.isprintable() else
                   f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else repr(c)[1:-1]
                   for c in s]                     # undecodable bytes (surrogates) as \xNN
    if sum(map(len, pieces)) <= limit:
        return "".join(pieces)
    out, n = [], 0
    for p in pieces:                           # cut between pieces, never inside an escape
        if n + len(p) > limit - 3:
            return "".join(out) + "..."
        out.append(p)
        n += len(p)
    return "".join(out)


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

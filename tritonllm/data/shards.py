"""Token shards in the llm.c / modded-nanogpt format, read memory-mapped.

A shard is a 1024-byte header of 256 little-endian int32 followed by the tokens:

====  =========================================================================
slot  meaning
====  =========================================================================
0     magic: 20240520 (GPT-2 style, version 1, uint16 tokens) or
      20240801 (Llama-3 style, version 7, uint32 tokens)
1     version (1 or 7, matching the magic)
2     number of tokens
====  =========================================================================

The corpora tritonllm tokenizes itself (the standard-library corpus, plain-text files) are cached
in the same format, so every data source reaches the loader as a list of memory-mapped shards.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from tritonllm.errors import DataError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
#: magic -> (version, token dtype)
FORMATS: dict[int, tuple[int, np.dtype]] = {20240520: (1, np.dtype("<u2")), 20240801: (7, np.dtype("<u4"))}


def magic_for_vocab(vocab_size: int) -> int:
    """The shard magic whose token dtype holds ids below ``vocab_size``."""
    return 20240520 if vocab_size <= 1 << 16 else 20240801


def open_shard(path: str) -> np.ndarray:
    """Validate the header of the shard at ``path`` and memory-map its tokens (1-D, read-only)."""
    try:
        size = os.path.getsize(path)
        header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    except OSError as e:
        raise DataError(f"cannot read token shard {path}: {e.strerror or e}") from None
    if header.size < HEADER_INTS:
        raise DataError(f"token shard {path} is {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, ntok = (int(v) for v in header[:3])
    if magic not in FORMATS:
        expected = " or ".join(str(m) for m in FORMATS)
        raise DataError(f"token shard {path} has magic {magic}; expected {expected} (llm.c format)")
    want_version, dtype = FORMATS[magic]
    if version != want_version:
        raise DataError(f"token shard {path} has version {version}; magic {magic} expects version {want_version}")
    expected_size = HEADER_BYTES + ntok * dtype.itemsize
    if ntok < 0 or size != expected_size:
        raise DataError(
            f"token shard {path} is {size} bytes; its header says {ntok} tokens of {dtype.itemsize} bytes, "
            f"i.e. {expected_size} bytes (truncated or corrupt file)"
        )
    if ntok == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(ntok,))


def cached_file_value(path: str, cache_dir: str | None, name: str, compute):
    """``compute()``, a JSON value derived from the file at ``path``, cached in
    ``<cache_dir>/<name>/`` under a key of the file's path, size and modification time (``cache_dir``
    None: not cached; a read-only cache: computed again next time)."""
    entry = None
    if cache_dir is not None:
        st = os.stat(path)
        key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
        entry = os.path.join(os.path.expanduser(cache_dir), name, f"{key}.json")
        try:
            with open(entry) as f:
                return json.load(f)["value"]
        except (OSError, ValueError, KeyError):
            pass
    found = compute()
    if entry is not None:
        try:
            os.makedirs(os.path.dirname(entry), exist_ok=True)
            tmp = f"{entry}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"path": os.path.abspath(path), "value": found}, f)
            os.replace(tmp, entry)
        except OSError:
            pass
    return found


def shard_max_id(path: str, tokens: np.ndarray, cache_dir: str | None = None) -> int:
    """The largest token id of the shard at ``path`` (``tokens``, its memory map; -1 when empty), read
    once with one vectorised max and cached in ``<cache_dir>/shard-max/`` (:func:`cached_file_value`)."""
    return int(cached_file_value(path, cache_dir, "shard-max", lambda: int(tokens.max()) if len(tokens) else -1))


class ShardWriter:
    """Write a shard incrementally: ``with ShardWriter(path, vocab_size) as w: w.write(ids)``.

    The header's token count is filled in on close, so a corpus can be streamed to disk without
    holding it in memory.
    """

    def __init__(self, path: str, vocab_size: int):
        self.path = path
        self.magic = magic_for_vocab(vocab_size)
        self.version, self.dtype = FORMATS[self.magic]
        self.count = 0
        self._f = open(path, "wb")
        self._f.write(b"\0" * HEADER_BYTES)

    def write(self, ids) -> None:
        arr = np.asarray(ids, dtype=self.dtype)
        self._f.write(arr.tobytes())
        self.count += arr.size

    def close(self) -> None:
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[:3] = (self.magic, self.version, self.count)
        self._f.seek(0)
        self._f.write(header.tobytes())
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()


def write_shard(path: str, ids, vocab_size: int) -> None:
    """Write the token ids ``ids`` to a new shard at ``path``."""
    with ShardWriter(path, vocab_size) as w:
        w.write(ids)

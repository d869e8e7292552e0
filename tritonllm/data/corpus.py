"""Corpora tokenized by tritonllm: the Python standard library's sources and plain-text files.

The standard-library corpus is defined by a checked-in manifest, ``stdlib_manifest.json`` (the
relative path and sha256 of every file, in the order read; ``scripts/stdlib_manifest.py`` writes it
from a Python 3.11 standard library): a machine reads exactly those files of its own standard library,
leaving out with one log line those it lacks or holds with other bytes, so two machines train on
the same corpus or say how theirs differs. Every corpus has a content hash (:func:`content_sha256`
of the files read, in order), which results carry.

Both are turned into one token shard (llm.c format, see :mod:`tritonllm.data.shards`) plus the
SentencePiece model that produced it, cached in ``<cache_dir>/<kind>-<hash>/`` where the hash
covers every setting that changes the result (the content hash and number of files, byte budget,
vocabulary size, the bytes of the tokenizer given or the training options). The cache entry is
built in a temporary folder and moved into place with ``os.replace``, so concurrent jobs of a sweep
never read a half-written entry.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import sysconfig

from tritonllm.data.shards import ShardWriter, cached_file_value
from tritonllm.data.tokenizer import SPM_OPTIONS, Tokenizer
from tritonllm.errors import DataError

log = logging.getLogger(__name__)

#: bump when the cached layout or the tokenization changes
CACHE_VERSION = 2
#: files this large get their sha256 cached (token shards); smaller ones are hashed at every load
HASH_CACHE_BYTES = 1 << 26
#: files read and encoded together (one multi-threaded SentencePiece call)
ENCODE_FILES = 256


#: the embedded corpus's definition: the standard-library files it reads (scripts/stdlib_manifest.py wrote it)
MANIFEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stdlib_manifest.json")


def python_sources(root: str) -> list[str]:
    """The rule that picked the manifest's files: the ``*.py`` files under ``root`` (the standard
    library), sorted, installed third-party packages excluded, and the few that are not UTF-8 text
    (the encoding tests' fixtures, e.g. ``test/encoded_modules/module_koi8_r.py``)."""
    files = glob.glob(os.path.join(glob.escape(root), "**", "*.py"), recursive=True)
    skip = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
    files = sorted(f for f in files if not any(s in f for s in skip))
    binary = set(not_text(files))
    return [f for f in files if f not in binary]


def file_sha256(path: str, cache_dir: str | None = None) -> str:
    """The sha256 (hex) of the bytes of the file at ``path``; files of HASH_CACHE_BYTES or more are
    hashed once, then cached under ``<cache_dir>/sha256/`` (:func:`~tritonllm.data.shards.cached_file_value`)."""
    def digest() -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        return h.hexdigest()

    try:
        if os.path.getsize(path) < HASH_CACHE_BYTES:
            return digest()
        return str(cached_file_value(path, cache_dir, "sha256", digest))
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def content_sha256(digests: list[str]) -> str:
    """A corpus's content hash from the sha256 (hex) of each file it reads, in order: the sha256 of
    their 32-byte digests concatenated. It names the bytes used and their order, not the paths, so
    two machines holding the same files in other folders agree."""
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest()


def read_manifest(manifest: str | None = None) -> dict:
    """The standard-library manifest (default :data:`MANIFEST`), JSON: ``python``, the version it was
    written from, and ``files``, ``[relative path, sha256]`` in the order read."""
    manifest = manifest or MANIFEST
    try:
        with open(manifest) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read the standard-library manifest {manifest}: {e}") from None


def manifest_files(manifest: str | None = None) -> list[str]:
    """The files of the standard-library ``manifest`` (:func:`read_manifest`) that this machine's
    standard library holds with the same bytes, in the manifest's order. Those missing or different
    are left out with one log line counting them."""
    spec = read_manifest(manifest)
    root = sysconfig.get_paths()["stdlib"]
    found, missing, different = [], 0, 0
    for rel, sha in spec["files"]:
        path = os.path.join(root, *rel.split("/"))
        if not os.path.isfile(path):
            missing += 1
        elif file_sha256(path) != sha:
            different += 1
        else:
            found.append(path)
    if missing or different:
        n = len(spec["files"])
        log.warning("data stdlib: of the manifest's %d files (Python %s), %d are missing and %d differ in this "
                    "machine's standard library (%s, Python %s): the corpus reads the other %d; its sha256 names them",
                    n, spec["python"], missing, different, root, sys.version.split()[0], len(found))
    return found


def stdlib_files(packages: bool = False, manifest: str | None = None) -> list[str]:
    """The embedded corpus's files: those of the standard-library ``manifest`` found unchanged on this
    machine (:func:`manifest_files`).

    ``packages``: then also the ``*.py`` files of the installed packages (every site-packages folder
    on ``sys.path`` and sysconfig's purelib/platlib, each file once, those that are not UTF-8 text
    left out), sorted after the standard library's: torch alone adds tens of millions of tokens,
    for runs that must not repeat their data. They depend on what is installed: the corpus's
    sha256 says which were read.
    """
    files = manifest_files(manifest)
    if not packages:
        return files
    seen = {os.path.realpath(f) for f in files}
    extra = []
    for site in package_roots():
        for f in sorted(glob.glob(os.path.join(glob.escape(site), "**", "*.py"), recursive=True)):
            real = os.path.realpath(f)
            if real not in seen and os.path.isfile(real):
                seen.add(real)
                extra.append(f)
    binary = set(not_text(extra))
    if binary:
        log.info("python corpus: left out %d package file(s) that are not UTF-8 text: %s", len(binary),
                 ", ".join(sorted(binary)[:20]))
    return files + [f for f in extra if f not in binary]


def package_roots() -> list[str]:
    """The folders installed packages live in: sysconfig's purelib and platlib, and the folders on
    ``sys.path`` named site-packages or dist-packages or holding ``*.dist-info`` records (a
    ``pip install --target`` folder on PYTHONPATH), sorted, each once, nested ones left out (their
    files are found from the outer folder)."""
    paths = sysconfig.get_paths()
    found = {os.path.realpath(p) for p in (paths["purelib"], paths["platlib"]) if os.path.isdir(p)}
    found |= {os.path.realpath(p) for p in sys.path if p and os.path.isdir(p) and (
        os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages")
        or glob.glob(os.path.join(glob.escape(p), "*.dist-info")))}
    roots = sorted(found)
    return [r for r in roots if not any(r != o and r.startswith(o + os.sep) for o in roots)]


def glob_files(pattern: str, key: str) -> list[str]:
    """Sorted files matching ``pattern`` (``~`` expanded, ``**`` recursive); a DataError naming the
    config ``key`` when nothing matches."""
    files = sorted(f for f in glob.glob(os.path.expanduser(str(pattern)), recursive=True) if os.path.isfile(f))
    if not files:
        raise DataError(f"{key}={pattern!r} matches no file")
    return files


def within_budget(files: list[str], max_bytes: int | None) -> list[str]:
    """The leading files of ``files`` whose sizes add up to at most ``max_bytes`` (at least one)."""
    if max_bytes is None:
        return list(files)
    chosen: list[str] = []
    total = 0
    for f in files:
        size = os.path.getsize(f)
        if chosen and total + size > max_bytes:
            break
        chosen.append(f)
        total += size
    return chosen


#: characters of a decoded file that text does not hold: U+FFFD (bytes that are not UTF-8) and control characters
_NOT_TEXT = re.compile(r"[\ufffd\x00-\x08\x0e-\x1f\x7f]")
#: share of those in the first TEXT_PROBE_BYTES of a file above which it is not text (random bytes: 55%,
#: Latin-1 French read as UTF-8: 16%, UTF-8 text: 0)
NOT_TEXT_FRACTION, TEXT_PROBE_BYTES = 0.3, 1 << 16


def not_text(files: list[str]) -> list[str]:
    """The files of ``files`` whose first 64 KiB are mostly not UTF-8 text (binary files, random bytes)."""
    found = []
    for path in files:
        try:
            with open(path, "rb") as f:
                text = f.read(TEXT_PROBE_BYTES).decode("utf-8", errors="replace")
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror or e}") from None
        if text and len(_NOT_TEXT.findall(text)) > NOT_TEXT_FRACTION * len(text):
            found.append(path)
    return found


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def tokenized_corpus(kind: str, files: list[str], vocab_size: int, tokenizer: str | None, cache_dir: str,
                     tokenizer_bytes: int | None = None) -> tuple[str, str, str]:
    """Tokenize ``files`` (one document each, end-of-document token after each) into a cached shard.

    ``tokenizer`` is the path of a SentencePiece model to use, or None to train a BPE model of
    ``vocab_size`` pieces on the leading ``tokenizer_bytes`` of the files. Returns the paths of
    the shard and of the tokenizer model in the cache, and the files' :func:`content_sha256`, which
    (with the tokenizer's bytes or training settings) keys the cache entry.
    """
    sha = content_sha256([file_sha256(f, cache_dir) for f in files])
    settings = {"version": CACHE_VERSION, "kind": kind, "files": len(files), "sha256": sha,
                "tokenizer": file_sha256(tokenizer) if tokenizer else None}
    if tokenizer is None:
        settings.update(vocab_size=int(vocab_size), tokenizer_bytes=tokenizer_bytes,
                        spm={k: v for k, v in SPM_OPTIONS.items() if k not in ("num_threads", "minloglevel")})
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = os.path.expanduser(str(cache_dir))
    entry = os.path.join(cache_dir, f"{kind}-{key}")
    shard, model = os.path.join(entry, "tokens.bin"), os.path.join(entry, "tokenizer.model")
    if os.path.isfile(os.path.join(entry, "meta.json")):
        return shard, model, sha
    if all(os.path.getsize(f) == 0 for f in files):
        raise DataError(f"the {len(files)} {kind} files of data.files are empty: {', '.join(files[:5])}"
                        f"{' ...' if len(files) > 5 else ''}; point data.files at files that hold text")
    binary = not_text(files)
    if binary:
        raise DataError(f"{len(binary)} of the {len(files)} {kind} files are not text (over "
                        f"{NOT_TEXT_FRACTION:.0%} of their first bytes are not UTF-8 characters): "
                        f"{', '.join(binary[:5])}{' ...' if len(binary) > 5 else ''}; remove them from data.files")
    os.makedirs(cache_dir, exist_ok=True)
    tmp = os.path.join(cache_dir, f".tmp-{kind}-{key}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        tmp_model = os.path.join(tmp, "tokenizer.model")
        if tokenizer is None:
            train_files = within_budget(files, tokenizer_bytes)
            log.info("training a %d-piece BPE tokenizer on %d %s files", vocab_size, len(train_files), kind)
            tok = Tokenizer.train((read_text(f) for f in train_files), tmp_model, vocab_size,
                                  what=f"{len(train_files)} {kind} files ({train_files[0]} ...)")
        else:
            shutil.copyfile(tokenizer, tmp_model)
            tok = Tokenizer(tmp_model)
        with ShardWriter(os.path.join(tmp, "tokens.bin"), tok.vocab_size) as w:
            for i in range(0, len(files), ENCODE_FILES):
                for ids in tok.encode_batch([read_text(f) for f in files[i:i + ENCODE_FILES]]):
                    w.write(ids)
                    w.write([tok.eos_id])
        meta = {"files": len(files), "bytes": sum(os.path.getsize(f) for f in files), "tokens": w.count,
                "vocab_size": tok.vocab_size, "settings": settings}
        with open(os.path.join(tmp, "meta.json"), "w") as out:
            json.dump(meta, out, indent=1)
        log.info("tokenized %d files (%d bytes) into %d tokens: %s", len(files), meta["bytes"], w.count, entry)
        try:
            os.replace(tmp, entry)
        except OSError:  # another job of a sweep built the same entry first
            if not os.path.isfile(os.path.join(entry, "meta.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return shard, model, sha

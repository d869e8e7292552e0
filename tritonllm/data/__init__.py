"""tritonllm.data: corpora, tokenizer, token shards and the batch loader.

``load_corpus(cfg.data)`` turns a data config (``conf/data/*.yaml``) into memory-mapped token
shards and the tokenizer that goes with them; ``corpus.loaders(...)`` gives the training and
validation :class:`TokenLoader`. Data kinds:

- ``stdlib``: the Python standard library's ``*.py`` files listed in the checked-in manifest
  (``stdlib_manifest.json``, with their sha256), those this machine holds unchanged (nothing to
  download), up to ``max_bytes``, tokenized with a BPE model of ``vocab_size`` pieces trained on them;
- ``text``: plain-text files matched by the glob ``files``, tokenized with the SentencePiece model
  ``tokenizer`` or one trained on them;
- ``bin``: pre-tokenized llm.c / modded-nanogpt shards matched by ``files`` (and ``val_files``).
- ``sft``: JSONL chat or instruction records for fine-tuning, loss on the responses only
  (:mod:`tritonllm.data.sft`, the tokenizer of a Hugging Face model folder).

A :class:`Corpus` knows its ``identity``: name, number of files, training and validation tokens and
the content sha256 of the files read (:func:`tritonllm.data.corpus.content_sha256`), the same on
every machine holding the same data; benchmarks record it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tritonllm.data.corpus import (content_sha256, file_sha256, glob_files, read_manifest, stdlib_files,
                                   tokenized_corpus, within_budget)
from tritonllm.data.loader import TokenLoader, TokenStream, split_stream
from tritonllm.data.shards import open_shard, shard_max_id, write_shard
from tritonllm.data.tokenizer import Tokenizer
from tritonllm.errors import ConfigError, DataError

if TYPE_CHECKING:
    from tritonllm.data.sft import SFTCorpus

__all__ = ["Corpus", "load_corpus", "Tokenizer", "TokenLoader", "TokenStream", "open_shard", "write_shard"]


@dataclass
class Corpus:
    """Token shards of one data config, ready to be cut into batches."""

    train_shards: list          # memory-mapped 1-D token arrays
    val_shards: list | None     # None: the last val_fraction of train_shards is validation
    val_fraction: float
    tokenizer: Tokenizer | None  # None for pre-tokenized shards given without a tokenizer
    vocab_size: int | None      # ids the data may hold (tokenizer or data.vocab_size); None if unknown
    name: str                   # what the data is: the kind and the manifest, glob or shard pattern read
    files: int                  # files read
    sha256: str                 # content_sha256 of the files read, in order
    max_ids: dict | None = None  # {shard path: largest id in it} of pre-tokenized shards, scanned at load

    def streams(self) -> tuple[TokenStream, TokenStream]:
        """The training and validation token ranges."""
        if self.val_shards is None:
            return split_stream(self.train_shards, self.val_fraction)
        return TokenStream(self.train_shards), TokenStream(self.val_shards)

    @property
    def identity(self) -> dict:
        """``{"name", "files", "train_tokens", "val_tokens", "sha256"}``: what a result was measured on."""
        train, val = self.streams()
        return {"name": self.name, "files": self.files, "train_tokens": len(train), "val_tokens": len(val),
                "sha256": self.sha256}

    @property
    def description(self) -> str:
        """One line naming the data: its identity."""
        i = self.identity
        return (f"{i['name']}: {i['files']} files, {i['train_tokens']} training + {i['val_tokens']} validation "
                f"tokens, sha256 {i['sha256'][:16]}")

    def loaders(self, batch_size: int, seq_len: int, seed: int, vocab_size: int | None, rank: int = 0,
                world_size: int = 1) -> tuple[TokenLoader, TokenLoader]:
        """Training loader (shuffled, seeded) and validation loader (in order); with several ranks,
        this ``rank``'s share of every global batch of ``world_size * batch_size`` windows. A shard
        holding an id outside ``vocab_size`` is a DataError naming it, now rather than when its window
        is drawn."""
        outside = {p: m for p, m in (self.max_ids or {}).items() if vocab_size is not None and m >= vocab_size}
        if outside:
            path, top = next(iter(outside.items()))
            raise DataError(f"token shard {path} holds id {top}, outside the model's vocabulary of {vocab_size} "
                            f"({len(outside)} shard(s) do); set data.vocab_size (or model.vocab_size) to cover "
                            f"the shards, or fix them")
        train, val = self.streams()
        return (TokenLoader(train, batch_size, seq_len, seed, True, vocab_size, "train", rank, world_size),
                TokenLoader(val, batch_size, seq_len, seed, False, vocab_size, "validation", rank, world_size))


def _tokenizer_path(cfg) -> str | None:
    path = cfg.get("tokenizer")
    if path is None:
        return None
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise DataError(f"data.tokenizer={path!r} does not exist")
    return path


def load_corpus(cfg) -> Corpus | SFTCorpus:
    """Build (or find in the cache) the token shards and tokenizer described by the data config ``cfg``."""
    kind = cfg.get("kind")
    val_fraction = float(cfg.get("val_fraction", 0.05))
    if kind in ("stdlib", "text"):
        if kind == "stdlib":
            packages = bool(cfg.get("packages", False))
            files = within_budget(stdlib_files(packages), cfg.get("max_bytes"))
            if not files:
                raise DataError("none of the standard-library manifest's files is in this machine's standard "
                                "library (sysconfig stdlib path): use data=text or data=bin")
            name = f"stdlib{'+packages' if packages else ''} (manifest of Python {read_manifest()['python']})"
        else:
            files = within_budget(glob_files(cfg.get("files"), "data.files"), cfg.get("max_bytes"))
            name = f"text {cfg.files}"
        shard, model, sha = tokenized_corpus(kind, files, cfg.get("vocab_size"), _tokenizer_path(cfg),
                                             cfg.cache_dir, cfg.get("tokenizer_bytes"))
        tok = Tokenizer(model)
        return Corpus([open_shard(shard)], None, val_fraction, tok, tok.vocab_size, name, len(files), sha)
    if kind == "bin":
        train_files = glob_files(cfg.get("files"), "data.files")
        val_files = glob_files(cfg.val_files, "data.val_files") if cfg.get("val_files") else []
        shards = {f: open_shard(f) for f in train_files + val_files}
        max_ids = {f: shard_max_id(f, tokens, cfg.get("cache_dir")) for f, tokens in shards.items()}
        path = _tokenizer_path(cfg)
        tokenizer = Tokenizer(path) if path else None
        vocab = cfg.get("vocab_size") or (tokenizer.vocab_size if tokenizer else None)
        sha = content_sha256([file_sha256(f, cfg.get("cache_dir")) for f in train_files + val_files])
        name = f"bin {cfg.files}" + (f" + {cfg.val_files}" if val_files else "")
        return Corpus([shards[f] for f in train_files], [shards[f] for f in val_files] if val_files else None,
                      val_fraction, tokenizer, vocab, name, len(train_files) + len(val_files), sha, max_ids)
    if kind == "sft":
        from tritonllm.data.sft import load_sft_corpus

        return load_sft_corpus(cfg)
    raise ConfigError(f"data.kind={kind!r} is not one of stdlib, text, bin, sft")

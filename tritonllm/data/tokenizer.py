"""SentencePiece BPE tokenizer: trained on a corpus, or loaded from a ``.model`` file.

Trained with settings that keep source code and plain text byte-exact through
``decode(encode(text))``: identity normalization, no dummy prefix, whitespace kept, newline and
tab as their own pieces, byte fallback for characters outside the vocabulary. Id 0 is ``<unk>``
and id 1 the end-of-document token appended after every file.
"""

from __future__ import annotations

import io
import os
from typing import Any, Iterable

from tritonllm.errors import DataError

#: training options for SentencePieceTrainer (vocab size and input are added per call)
SPM_OPTIONS: dict[str, Any] = dict(
    model_type="bpe",
    character_coverage=0.9995,  # rarer characters are spelled as bytes (byte_fallback)
    byte_fallback=True,
    remove_extra_whitespaces=False,
    normalization_rule_name="identity",
    add_dummy_prefix=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    user_defined_symbols=["\n", "\t"],
    max_sentence_length=1 << 14,
    max_sentencepiece_length=16,
    unk_id=0,
    eos_id=1,
    bos_id=-1,
    pad_id=-1,
    hard_vocab_limit=False,
    num_threads=max(1, min(8, os.cpu_count() or 1)),
    minloglevel=2,
)


class Tokenizer:
    """A SentencePiece model: ``encode(text) -> list[int]``, ``decode(ids) -> str``."""

    def __init__(self, path: str):
        import sentencepiece as spm

        if not os.path.isfile(path):
            raise DataError(f"tokenizer model {path} does not exist")
        self.path = path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.load(path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"tokenizer model {path} is not a readable SentencePiece model: {e}") from None

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, encoded on ``SPM_OPTIONS["num_threads"]`` threads."""
        return self.sp.encode(texts, num_threads=SPM_OPTIONS["num_threads"])

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    @staticmethod
    def train(texts: Iterable[str], path: str, vocab_size: int, what: str) -> "Tokenizer":
        """Train a BPE model of at most ``vocab_size`` pieces on ``texts`` (one document per item)
        and write it to ``path``; ``what`` names the corpus in error messages."""
        import sentencepiece as spm

        empty = True  # no line given to sentencepiece yet

        def lines():
            nonlocal empty
            for text in texts:
                for line in text.split("\n"):
                    if line:
                        empty = False
                        yield line
        buf = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(sentence_iterator=lines(), model_writer=buf, vocab_size=int(vocab_size),
                                           **SPM_OPTIONS)
        except RuntimeError as e:
            if empty:
                raise DataError(f"cannot train a tokenizer on {what}: they hold no text (only empty lines)") from None
            raise DataError(f"training a {vocab_size}-piece tokenizer on {what} failed: {e}") from None
        with open(path, "wb") as f:
            f.write(buf.getvalue())
        return Tokenizer(path)

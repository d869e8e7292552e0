"""Supervised fine-tuning data: JSONL instruction or chat records, loss on the responses only.

``data=sft data.files='chat/*.jsonl'`` (``conf/data/sft.yaml``): every line of every file is one
JSON record, either

* chat: ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}``
  with at least one assistant message, or
* instruction: ``{"prompt": "...", "response": "..."}`` (read as a user and an assistant message).

Encoding: with the tokenizer's chat template (``data.chat_template: true`` and the model folder
has one), the conversation is rendered by the template and cut at the message boundaries: the
tokens of each assistant turn (from the end of the generation prompt the template adds for it to
the end of the turn, end-of-turn tokens included) are trained on, every other token is context.
Without a template the fallback layout is ``<bos>role: content\\n`` per message with the assistant
turns written ``assistant: `` (context) + ``content<eos>`` (trained).

Batches: one example per row, ``[batch_size, seq_len]``: ``x`` the tokens (an example longer than
``seq_len + 1`` tokens is cut), ``y`` the next tokens with ``-100`` (ignored by the loss) where
the next token is context or padding; rows are padded at the end, after every real token, so the
causal attention never lets a real token see padding. The loss of a batch is the mean over its
trained tokens. The training loader visits the examples in a fresh seeded permutation per epoch;
its state is ``(epoch, index)``, saved in checkpoints like :class:`~tritonllm.data.TokenLoader`'s.
With several ranks, each batch is rank ``r``'s rows ``[r B, (r + 1) B)`` of a global batch of
``world_size * B`` consecutive examples of the order.

Packing (``data.pack=true``): consecutive examples of the order are laid end to end in rows of
``seq_len + 1`` tokens, greedily: an example that does not fit in what is left of a row starts the
next row (an example longer than a row is cut to it, alone in its row, as without packing), and a
global batch ends when its ``world_size * B`` rows are full; the example that did not fit is the
first of the next batch. Each example keeps all its tokens and its trained mask; ``y = -100`` also
at the last position of each example (its next token belongs to the next example) and on the
padding that ends a row. Padding forms a document of its own. Batches are ``(x, y, documents)``
with ``documents`` the int32 ``[B, seq_len, 2]`` bounds of each position's example
(:func:`document_bounds`) for ``flash_attention(documents=...)``, so an example attends only to its
own tokens. Positions are not restarted per example: RoPE scores depend only on the distance between
a query and a key, so an example's attention is that of the example alone. ``(epoch, index)`` is
the next example to pack (as without packing, the next one to read), so a run resumed mid-epoch
packs the same rows from the same example on.

A malformed record is a :class:`~tritonllm.errors.DataError` naming the file, the line and the field.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import torch

from tritonllm.errors import DataError

log = logging.getLogger(__name__)

IGNORE = -100
ROLES = ("system", "user", "assistant", "tool")


def document_bounds(doc_ids: np.ndarray) -> np.ndarray:
    """int32 ``[B, T, 2]`` bounds of packed documents for ``flash_attention(documents=...)``: for each
    position of ``doc_ids [B, T]`` (a document is a maximal run of equal ids along a row), the first
    position of its document and one past its last."""
    ids = np.asarray(doc_ids)
    if ids.ndim != 2:
        raise ValueError(f"doc_ids must be [B, T], got shape {ids.shape}")
    B, T = ids.shape
    out = np.empty((B, T, 2), dtype=np.int32)
    for row in range(B):
        cuts = np.flatnonzero(ids[row, 1:] != ids[row, :-1]) + 1
        starts, ends = np.concatenate(([0], cuts)), np.concatenate((cuts, [T]))
        lengths = ends - starts
        out[row, :, 0] = np.repeat(starts, lengths)
        out[row, :, 1] = np.repeat(ends, lengths)
    return out


def read_records(files: list[str]) -> list[tuple[str, list[dict]]]:
    """``(where, messages)`` of every record of the JSONL ``files`` (``where`` = ``file:line``)."""
    out = []
    for file in files:
        with open(file, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{file}:{n}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
                out.append((where, _messages(record, where)))
    if not out:
        raise DataError(f"the SFT files {files} hold no records")
    return out


def _messages(record, where: str) -> list[dict]:
    """The record as a list of messages; a DataError naming the bad field otherwise."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object with 'messages' or 'prompt'/'response', "
                        f"got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: field 'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise DataError(f"{where}: field 'messages[{i}]' must be an object with 'role' and 'content'")
            if m.get("role") not in ROLES:
                raise DataError(f"{where}: field 'messages[{i}].role' must be one of {ROLES}, got {m.get('role')!r}")
            if not isinstance(m.get("content"), str):
                raise DataError(f"{where}: field 'messages[{i}].content' must be a string")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: field 'messages' has no assistant message to train on")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    for key in ("prompt", "response"):
        if not isinstance(record.get(key), str):
            raise DataError(f"{where}: field '{key}' must be a string (or give 'messages')")
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]


def _pieces_from_template(tok, messages: list[dict], where: str) -> list[tuple[str, bool]]:
    """``(text, trained)`` pieces of the conversation rendered with the chat template."""
    pieces, done = [], ""
    for k, m in enumerate(messages):
        full = tok.apply_chat_template(messages[:k + 1])
        if m["role"] == "assistant":
            prompt = tok.apply_chat_template(messages[:k], add_generation_prompt=True)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise DataError(f"{where}: the chat template does not render message {k} as an extension of the "
                                f"earlier ones; use data.chat_template=false")
            pieces += [(prompt[len(done):], False), (full[len(prompt):], True)]
        else:
            if not full.startswith(done):
                raise DataError(f"{where}: the chat template does not render message {k} as an extension of the "
                                f"earlier ones; use data.chat_template=false")
            pieces.append((full[len(done):], False))
        done = full
    return pieces


def encode_example(tok, messages: list[dict], where: str, use_template: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, trained)``: the token ids of one conversation and whether each is a response token."""
    ids: list[int] = []
    trained: list[bool] = []
    if use_template:
        pieces = _pieces_from_template(tok, messages, where)
    else:
        if tok.bos_id is not None:
            ids.append(tok.bos_id)
            trained.append(False)
        pieces = []
        for m in messages:
            if m["role"] == "assistant":
                pieces += [("assistant: ", False), (m["content"], True)]
                if tok.eos_id is None:
                    pieces.append(("\n", True))
            else:
                pieces.append((f"{m['role']}: {m['content']}\n", False))
    for text, train in pieces:
        piece = tok.encode(text) if text else []
        ids += piece
        trained += [train] * len(piece)
        if train and not use_template and tok.eos_id is not None:
            ids.append(tok.eos_id)
            trained.append(True)
    return np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool)


class SFTLoader:
    """``next_batch() -> (x, y)``: int64 ``[batch_size, seq_len]`` CPU tensors, one example per row,
    ``y = -100`` where no loss is taken (context, padding). ``shuffle=False`` reads in order.
    ``pack=True``: several examples per row and batches ``(x, y, documents)`` (module docstring)."""

    def __init__(self, examples: list[tuple[np.ndarray, np.ndarray]], batch_size: int, seq_len: int, seed: int,
                 shuffle: bool = True, vocab_size: int | None = None, name: str = "train", pad_id: int = 0,
                 rank: int = 0, world_size: int = 1, pack: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.rank, self.world_size = int(rank), int(world_size)
        if not examples:
            raise DataError(f"the {name} split holds no SFT examples; use more data or another data.val_fraction")
        self.examples, self.batch_size, self.seq_len = examples, int(batch_size), int(seq_len)
        self.seed, self.shuffle, self.name, self.pad_id = int(seed), shuffle, name, int(pad_id)
        self.pack = bool(pack)
        if self.pack and not any(len(ids) for ids, _ in examples):
            raise DataError(f"the {name} SFT examples hold no tokens to pack")
        if vocab_size is not None:
            top = max(int(ids.max()) for ids, _ in examples if len(ids))
            if top >= vocab_size:
                raise DataError(f"the {name} SFT data holds token id {top}, outside the model's vocabulary of "
                                f"{vocab_size}: the tokenizer does not belong to the model")
        self.epoch, self.index = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.examples))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def batch(self, example_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` of the examples ``example_ids``, padded at the end."""
        T = self.seq_len
        x = np.full((len(example_ids), T), self.pad_id, dtype=np.int64)
        y = np.full((len(example_ids), T), IGNORE, dtype=np.int64)
        for row, e in enumerate(example_ids):
            ids, trained = self.examples[e]
            ids, trained = ids[:T + 1], trained[:T + 1]
            n = len(ids) - 1
            if n < 1:
                continue
            x[row, :n] = ids[:-1]
            y[row, :n] = np.where(trained[1:], ids[1:], IGNORE)
        return torch.from_numpy(x), torch.from_numpy(y)

    def packed_batch(self, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x, y, documents)`` of ``rows``, each a list of example ids laid end to end in
        ``seq_len + 1`` tokens (what :meth:`_pack` plans), padded at the end."""
        T = self.seq_len
        tokens = np.full((len(rows), T + 1), self.pad_id, dtype=np.int64)
        trained = np.zeros((len(rows), T + 1), dtype=bool)
        doc = np.empty((len(rows), T + 1), dtype=np.int64)
        for r, row in enumerate(rows):
            at = 0
            for k, e in enumerate(row):
                ids, mask = self.examples[e]
                n = min(len(ids), T + 1)
                tokens[r, at:at + n], trained[r, at:at + n], doc[r, at:at + n] = ids[:n], mask[:n], k
                at += n
            doc[r, at:] = len(row)  # the padding: a document of its own
        same = doc[:, 1:] == doc[:, :-1]  # no target across a document boundary
        y = np.where(trained[:, 1:] & same, tokens[:, 1:], IGNORE)
        return (torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(y),
                torch.from_numpy(document_bounds(doc[:, :-1])))

    def _pack(self, epoch: int, index: int):
        """The ``world_size * batch_size`` rows of the global batch packed from example ``index`` of
        epoch ``epoch``'s order on, and the position after it: ``(rows, epoch, index)``."""
        rows: list[list[int]] = [[]]
        room, used = self.seq_len + 1, 0
        order = self._order(epoch)
        while True:
            if index == len(self.examples):
                epoch, index = epoch + 1, 0
                order = self._order(epoch)
            e = int(order[index])
            n = min(len(self.examples[e][0]), room)
            if used + n > room:
                if len(rows) == self.world_size * self.batch_size:
                    return rows, epoch, index
                rows.append([])
                used = 0
            rows[-1].append(e)
            used += n
            index += 1

    def _share(self, rows: list) -> list:
        return rows[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """This rank's share of the next global batch; when it begins a new epoch, rank 0 logs one INFO
        line (``data: epoch K begins: the training data repeats (N examples)``), as the token loader does."""
        epoch = self.epoch
        out: tuple[torch.Tensor, ...]
        if self.pack:
            rows, self.epoch, self.index = self._pack(self.epoch, self.index)
            out = self.packed_batch(self._share(rows))
        else:
            ids = []
            order = self._order(self.epoch)
            for _ in range(self.batch_size * self.world_size):
                if self.index == len(self.examples):
                    self.epoch, self.index = self.epoch + 1, 0
                    order = self._order(self.epoch)
                ids.append(int(order[self.index]))
                self.index += 1
            out = self.batch(self._share(ids))
        if self.epoch != epoch and self.shuffle and self.rank == 0:
            log.info("data: epoch %d begins: the %s data repeats (%d examples)", self.epoch + 1,
                     "training" if self.name == "train" else self.name, len(self.examples))
        return out

    def batches(self, n: int):
        """The first ``n`` batches in order (cycling when the split is short); leaves the state alone."""
        if self.pack:
            epoch, index = 0, 0
            for _ in range(n):
                rows, epoch, index = self._pack(epoch, index)
                yield self.packed_batch(self._share(rows))
            return
        per_step = self.batch_size * self.world_size
        first = self.rank * self.batch_size
        for b in range(n):
            yield self.batch([(b * per_step + first + i) % len(self.examples) for i in range(self.batch_size)])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "n_examples": len(self.examples),
                "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if (state.get("n_examples"), state.get("seq_len")) != (len(self.examples), self.seq_len):
            raise DataError(f"the saved {self.name} SFT position is for {state.get('n_examples')} examples of "
                            f"{state.get('seq_len')} tokens, this run has {len(self.examples)} of {self.seq_len}: "
                            f"resume with the same data and trainer.seq_len")
        self.epoch, self.index, self.seed = int(state["epoch"]), int(state["index"]), int(state["seed"])


class SFTCorpus:
    """Encoded SFT examples of one data config, ready to be cut into batches (the interface of
    :class:`tritonllm.data.Corpus`: ``loaders``, ``tokenizer``, ``vocab_size``, ``description``)."""

    def __init__(self, train, val, tokenizer, description: str, pack: bool = False):
        self.train, self.val, self.tokenizer, self.description = train, val, tokenizer, description
        self.pack = pack
        self.vocab_size = None  # the model's vocabulary stays (a tokenizer may count fewer ids)

    def loaders(self, batch_size: int, seq_len: int, seed: int, vocab_size: int | None, rank: int = 0,
                world_size: int = 1):
        pad = self.tokenizer.eos_id or 0
        return (SFTLoader(self.train, batch_size, seq_len, seed, True, vocab_size, "train", pad, rank, world_size,
                          self.pack),
                SFTLoader(self.val, batch_size, seq_len, seed, False, vocab_size, "validation", pad, rank,
                          world_size, self.pack))


def load_sft_corpus(cfg) -> SFTCorpus:
    """The SFT corpus of the data config ``cfg`` (``files``, ``val_files``, ``val_fraction``,
    ``tokenizer``: a Hugging Face model folder, ``chat_template``, ``pack``)."""
    from tritonllm.data.corpus import glob_files
    from tritonllm.data.hf_tokenizer import HFTokenizer

    if cfg.get("tokenizer") is None:
        raise DataError("data.tokenizer: SFT data needs a Hugging Face model folder with a tokenizer.json "
                        "(set by +model=hf model.path=<dir>, or data.tokenizer=<dir>)")
    tok = HFTokenizer(str(cfg.tokenizer))
    use_template = bool(cfg.get("chat_template", True)) and tok.chat_template is not None
    if not use_template:
        log.info("SFT: no chat template used; messages are written as 'role: content' lines")

    def encode(files_key):
        return [encode_example(tok, msgs, where, use_template)
                for where, msgs in read_records(glob_files(cfg[files_key], f"data.{files_key}"))]

    train = encode("files")
    if cfg.get("val_files"):
        val = encode("val_files")
    else:
        n_val = max(1, int(round(len(train) * float(cfg.get("val_fraction", 0.05)))))
        if n_val >= len(train):
            raise DataError(f"data.files holds {len(train)} SFT examples: too few to hold out {n_val} for "
                            f"validation; give data.val_files")
        train, val = train[:-n_val], train[-n_val:]
    trained = sum(int(t.sum()) for _, t in train)
    pack = bool(cfg.get("pack", False))
    return SFTCorpus(train, val, tok, f"sft: {len(train)} train / {len(val)} validation examples, "
                                      f"{trained} trained tokens, chat template {'on' if use_template else 'off'}, "
                                      f"packing {'on' if pack else 'off'}", pack)

"""Batches of token windows drawn from memory-mapped shards, deterministic given a seed.

The shards are concatenated into one token stream and split into a training range and a
validation range. A range is cut into non-overlapping windows of ``seq_len + 1`` tokens (input
and next-token target, consecutive windows share one token); the training loader visits the
windows in a fresh permutation every epoch (``numpy.random.default_rng([seed, epoch])``), the
validation loader always reads its first windows in order. When the training windows are used up
and the next epoch begins, rank 0 logs one INFO line, ``data: epoch K begins: the training data
repeats (N tokens)``. Only the windows of the current batch are read from disk. The loader's whole
state is ``(epoch, index)``, saved in checkpoints.

Several ranks (``rank`` of ``world_size``): each batch is a rank's share of a global batch of
``world_size * batch_size`` consecutive windows of the order, rank ``r`` taking rows
``r * batch_size .. (r + 1) * batch_size - 1``; the shares are disjoint and together are what one
loader of the global batch size reads. ``(epoch, index)`` counts global windows, the same on every
rank, so a saved position resumes on any world size.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tritonllm.errors import DataError

log = logging.getLogger(__name__)


class TokenStream:
    """Tokens ``[start, end)`` of the concatenation of ``shards`` (1-D arrays, usually memmaps)."""

    def __init__(self, shards: list[np.ndarray], start: int = 0, end: int | None = None):
        self.shards = shards
        self.offsets = np.cumsum([0] + [len(s) for s in shards])
        self.start = start
        self.end = int(self.offsets[-1]) if end is None else end

    def __len__(self) -> int:
        return self.end - self.start

    def read(self, pos: int, n: int) -> np.ndarray:
        """Tokens ``pos .. pos+n-1`` of this range as int64 (may span shard boundaries)."""
        lo = self.start + pos
        out = np.empty(n, dtype=np.int64)
        done = 0
        while done < n:
            i = int(np.searchsorted(self.offsets, lo + done, side="right")) - 1
            off = lo + done - int(self.offsets[i])
            take = min(n - done, len(self.shards[i]) - off)
            out[done:done + take] = self.shards[i][off:off + take]
            done += take
        return out


def split_stream(shards: list[np.ndarray], val_fraction: float) -> tuple[TokenStream, TokenStream]:
    """Training and validation ranges: the last ``val_fraction`` of the tokens is validation."""
    whole = TokenStream(shards)
    n_val = int(round(len(whole) * float(val_fraction)))
    return TokenStream(shards, 0, len(whole) - n_val), TokenStream(shards, len(whole) - n_val, len(whole))


class TokenLoader:
    """``next_batch() -> (x, y)``, int64 CPU tensors of shape ``[batch_size, seq_len]``, y = x shifted by one.

    ``shuffle=False`` reads windows in order (validation). ``vocab_size``, when given, rejects a
    batch holding an id outside the model's vocabulary with a DataError instead of letting the
    embedding read out of bounds. ``name`` labels the split in messages. ``rank`` / ``world_size``:
    this loader's share of each global batch (module docstring).
    """

    def __init__(self, stream: TokenStream, batch_size: int, seq_len: int, seed: int, shuffle: bool = True,
                 vocab_size: int | None = None, name: str = "train", rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.rank, self.world_size = int(rank), int(world_size)
        self.stream, self.batch_size, self.seq_len = stream, int(batch_size), int(seq_len)
        self.seed, self.shuffle, self.vocab_size, self.name = int(seed), shuffle, vocab_size, name
        self.n_windows = (len(stream) - 1) // self.seq_len if len(stream) > 0 else 0
        if self.n_windows < 1:
            raise DataError(f"the {name} split has {len(stream)} tokens, fewer than seq_len + 1 = {self.seq_len + 1}; "
                            f"use more data, a smaller seq_len or another data.val_fraction")
        self.epoch, self.index = 0, 0
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    @property
    def epoch_tokens(self) -> int:
        """Training tokens in one pass over the split (``n_windows * seq_len``)."""
        return self.n_windows * self.seq_len

    def _window_id(self, epoch: int, index: int) -> int:
        if not self.shuffle:
            return index
        if self._order is None or self._order_epoch != epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._order_epoch = epoch
        return int(self._order[index])

    def _batch(self, window_ids) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.seq_len
        rows = np.stack([self.stream.read(w * t, t + 1) for w in window_ids])
        if self.vocab_size is not None and rows.max() >= self.vocab_size:
            raise DataError(f"the {self.name} data holds token id {int(rows.max())}, outside the model's vocabulary "
                            f"of {self.vocab_size}; set data.vocab_size (or model.vocab_size) to cover the shards")
        batch = torch.from_numpy(rows)
        return batch[:, :-1], batch[:, 1:]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the next global batch."""
        ids = []
        first = self.rank * self.batch_size
        for j in range(self.world_size * self.batch_size):
            if self.index == self.n_windows:
                self.epoch, self.index = self.epoch + 1, 0
                if self.shuffle and self.rank == 0:
                    log.info("data: epoch %d begins: the %s data repeats (%d tokens)", self.epoch + 1,
                             "training" if self.name == "train" else self.name, self.epoch_tokens)
            if first <= j < first + self.batch_size:
                ids.append(self._window_id(self.epoch, self.index))
            self.index += 1
        return self._batch(ids)

    def batches(self, n: int):
        """This rank's shares of the first ``n`` global batches in order (cycling when the split is
        short); leaves the state alone."""
        global_batch = self.world_size * self.batch_size
        for b in range(n):
            first = b * global_batch + self.rank * self.batch_size
            yield self._batch([(first + i) % self.n_windows for i in range(self.batch_size)])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "n_windows": self.n_windows,
                "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if (state["n_windows"], state["seq_len"]) != (self.n_windows, self.seq_len):
            raise DataError(f"the saved {self.name} data position is for {state['n_windows']} windows of "
                            f"{state['seq_len']} tokens, this run has {self.n_windows} windows of {self.seq_len}: "
                            f"resume with the same data and trainer.seq_len")
        self.epoch, self.index, self.seed = int(state["epoch"]), int(state["index"]), int(state["seed"])

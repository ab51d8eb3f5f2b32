"""Text for the language model: a corpus that ships with Python, a byte tokenizer, window data sets.

What it is:

* `load_corpus("pydoc")`: the Python documentation's topics (the text `help()` shows
  for statements, operators and special methods), `pydoc_data.topics` in the standard
  library: 466 KB of real English prose with some code, no download. The topics are
  joined in their stored order, so the file is one fixed, readable text.
* The byte tokenizer: `encode(text)` is the text's UTF-8 bytes (vocabulary 256, every
  token one byte, so a loss in nats per token is bits per byte after dividing by ln 2);
  `decode(ids)` the reverse (invalid UTF-8 sequences become U+FFFD).
* `load_text_split(block_size)`: the corpus cut into a training range and the
  validation range after it (contiguous: no window crosses from one into the other).
* `RandomWindows(tokens, block_size)`: the training set, nanoGPT's `get_batch` as a data set:
  windows at random starts drawn from (seed, epoch) alone, the same on every rank and strategy.
* `Windows(tokens, block_size)`: the evaluation set, the tokens tiled by consecutive
  windows (the last partial one dropped), the same every epoch.
* `unigram_loss(train, val)`: the cross-entropy (nats per byte) of the validation bytes
  under the training bytes' frequencies (add-one smoothed): the baseline a model must beat.

What it is not: no BPE or other subword tokenizer, no streaming of corpora larger than memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["CORPORA", "load_corpus", "encode", "decode", "RandomWindows", "Windows", "TextSplit",
           "load_text_split", "unigram_loss", "VOCAB_SIZE"]

VOCAB_SIZE = 256  # bytes
CORPORA = ("pydoc",)


def load_corpus(name: str = "pydoc") -> str:
    """The text of a corpus that ships with Python (see the module docstring)."""
    if name != "pydoc":
        raise ValueError(f"unknown corpus {name!r}; expected one of {CORPORA}")
    from pydoc_data.topics import topics  # local: 0.5 MB of strings, only the language model needs them

    return "".join(topics.values())


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids, uint8 (N,)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(ids) -> str:
    """Token ids (0..255) back to text; invalid UTF-8 becomes U+FFFD."""
    return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def _check_tokens(tokens: np.ndarray, block_size: int) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
    if block_size < 1 or len(tokens) < block_size + 1:
        raise ValueError(f"need block_size >= 1 and at least block_size + 1 = {block_size + 1} tokens, "
                         f"got block_size={block_size} and {len(tokens)} tokens")
    return tokens


def _windows(tokens: np.ndarray, starts: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """x (b, T) = tokens[s : s + T], y (b, T) = tokens[s + 1 : s + T + 1] for each start s, int64."""
    offsets = starts[:, None] + np.arange(block_size + 1)  # (b, T + 1)
    w = tokens[offsets].astype(np.int64)
    return w[:, :-1], w[:, 1:]


class RandomWindows:
    """Training windows at random starts, `num_windows` per epoch (default: len // block_size,
    about one pass over the tokens).

    Sample k of epoch e is the window of block_size + 1 tokens starting at starts(e)[k], a uniform
    draw from (seed, e) alone, so every rank and every strategy sees the same windows; x is its
    first block_size tokens and y the next token at each position (x shifted by one). With
    `trainer.data.iter_local_batches` splitting each global batch of window indices by rank, this
    is the distributed sampler of random windows."""

    def __init__(self, tokens: np.ndarray, block_size: int, num_windows: int | None = None, *, seed: int = 0) -> None:
        self.tokens = _check_tokens(tokens, block_size)
        self.block_size = block_size
        self.num_windows = len(self.tokens) // block_size if num_windows is None else int(num_windows)
        if self.num_windows < 0:
            raise ValueError(f"num_windows must be >= 0, got {self.num_windows}")
        self.seed = seed
        self._cached: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.num_windows

    def starts(self, epoch: int) -> np.ndarray:
        """(num_windows,) window starts of `epoch`, uniform in [0, len - block_size - 1]."""
        if self._cached is None or self._cached[0] != epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(self.seed), int(epoch), 0x7E47])))
            high = len(self.tokens) - self.block_size  # exclusive: the window's last target is tokens[s + T]
            self._cached = (epoch, rng.integers(0, high, size=self.num_windows))
        return self._cached[1]

    def get(self, indices: np.ndarray, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        return _windows(self.tokens, self.starts(epoch)[np.asarray(indices, dtype=np.int64)], self.block_size)


class Windows:
    """Consecutive windows tiling the tokens (evaluation): window k starts at k * block_size."""

    def __init__(self, tokens: np.ndarray, block_size: int) -> None:
        self.tokens = _check_tokens(tokens, block_size)
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def get(self, indices: np.ndarray, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        return _windows(self.tokens, np.asarray(indices, dtype=np.int64) * self.block_size, self.block_size)


@dataclass(frozen=True)
class TextSplit:
    train: RandomWindows
    val: Windows
    vocab_size: int = VOCAB_SIZE
    bytes_per_token: float = 1.0  # the byte tokenizer: bits per byte = loss / ln 2

    @property
    def tokens_per_sample(self) -> int:
        """Tokens of one training window, e.g. 64: trainer.loop reports tokens/s with it."""
        return self.train.block_size

    @property
    def unigram_loss(self) -> float:
        """The validation loss of predicting every target byte by the training set's byte frequencies (nats)."""
        targets = self.val.tokens[1 : len(self.val) * self.val.block_size + 1]  # what the windows predict
        return unigram_loss(self.train.tokens, targets)


def load_text_split(block_size: int, *, corpus: str = "pydoc", val_fraction: float = 0.1, seed: int = 0,
                    windows_per_epoch: int | None = None) -> TextSplit:
    """The corpus as byte tokens: the first (1 - val_fraction) for training (random windows), the
    rest for validation (consecutive windows)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tokens = encode(load_corpus(corpus))
    cut = int(round(len(tokens) * (1.0 - val_fraction)))
    return TextSplit(RandomWindows(tokens[:cut], block_size, windows_per_epoch, seed=seed),
                     Windows(tokens[cut:], block_size))


def unigram_loss(train: np.ndarray, val: np.ndarray) -> float:
    """Cross-entropy in nats per token of `val` under the add-one smoothed unigram of `train`."""
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=VOCAB_SIZE).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())  # (V,)
    val = np.asarray(val, dtype=np.int64)
    return float(-logp[val].mean()) if len(val) else math.nan

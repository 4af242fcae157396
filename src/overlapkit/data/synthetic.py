"""Synthetic image and token datasets: deterministic by seed and index, learnable,
with an optional per-sample cost that emulates slow storage or decoding."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset


def spend(milliseconds: float, kind: str) -> None:
    """Take ``milliseconds``: asleep (like waiting on storage) or of this thread's own
    CPU time (like decoding: a fixed amount of work, however many threads share the core)."""
    if milliseconds <= 0:
        return
    if kind == "sleep":
        time.sleep(milliseconds / 1000)
        return
    deadline = time.thread_time() + milliseconds / 1000
    x = 1.0
    while time.thread_time() < deadline:
        for _ in range(200):
            x = x * 1.0000001 + 1e-9


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + index + 1)


class SyntheticImages(Dataset):
    """Noise plus a per-class pattern: sample ``i`` is the same for a given seed,
    on every rank and in every run."""

    def __init__(
        self,
        shape: tuple[int, ...] = (3, 32, 32),
        num_classes: int = 10,
        num_samples: int = 2048,
        seed: int = 0,
        signal: float = 0.5,
        cost_ms: float = 0.0,
        cost_kind: str = "sleep",
        split: int = 0,
    ) -> None:
        self.split = split  # 0 = train, 1 = eval: other samples, same class patterns
        self.shape, self.num_classes, self.num_samples = tuple(shape), num_classes, num_samples
        self.seed, self.signal, self.cost_ms, self.cost_kind = seed, signal, cost_ms, cost_kind
        # The patterns depend on the seed only, so train and eval splits share them.
        self.patterns = torch.randn(num_classes, *self.shape, generator=_generator(seed, -2))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        generator = _generator(self.seed + 7919 * (self.split + 1), index)
        label = int(torch.randint(self.num_classes, (1,), generator=generator))
        image = torch.randn(self.shape, generator=generator) + self.signal * self.patterns[label]
        spend(self.cost_ms, self.cost_kind)
        return image, label


CLS_ID = 1
MARKERS_PER_CLASS = 8


class SyntheticTokens(Dataset):
    """Random token sequences in which an eighth of the positions carry marker
    tokens of the sample's class; position 0 is a [CLS] token."""

    def __init__(
        self,
        seq_len: int = 128,
        vocab_size: int = 30522,
        num_classes: int = 2,
        num_samples: int = 2048,
        seed: int = 0,
        cost_ms: float = 0.0,
        cost_kind: str = "sleep",
        split: int = 0,
    ) -> None:
        self.split = split
        first_plain = 2 + num_classes * MARKERS_PER_CLASS
        if vocab_size <= first_plain:
            raise ValueError(f"vocab_size must exceed {first_plain} for {num_classes} classes")
        self.seq_len, self.vocab_size, self.num_classes = seq_len, vocab_size, num_classes
        self.num_samples, self.seed, self.cost_ms, self.cost_kind = (
            num_samples,
            seed,
            cost_ms,
            cost_kind,
        )
        self.first_plain = first_plain

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        generator = _generator(self.seed + 104729 * (self.split + 1), index)
        label = int(torch.randint(self.num_classes, (1,), generator=generator))
        tokens = torch.randint(
            self.first_plain, self.vocab_size, (self.seq_len,), generator=generator
        )
        count = max(1, self.seq_len // 8)
        positions = torch.randint(1, max(2, self.seq_len), (count,), generator=generator)
        markers = torch.randint(MARKERS_PER_CLASS, (count,), generator=generator)
        tokens[positions] = 2 + label * MARKERS_PER_CLASS + markers
        tokens[0] = CLS_ID
        spend(self.cost_ms, self.cost_kind)
        return tokens, label

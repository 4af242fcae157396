"""The examples' data and model: a 1-D CNN that tells four kinds of waveform apart."""

from __future__ import annotations

import math
import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset

# Emulates slow storage (the tests use it to stop a run mid-way).
DELAY_S = float(os.environ.get("WAVES_DELAY_MS", "0")) / 1000


class Waveforms(Dataset):
    """Sine, square, sawtooth and triangle waves with random frequency, phase and noise."""

    kinds = 4

    def __init__(self, count: int, length: int = 128, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        t = torch.linspace(0, 1, length)
        self.labels = torch.randint(self.kinds, (count,), generator=generator)
        frequency = 2 + 6 * torch.rand(count, 1, generator=generator)
        phase = torch.rand(count, 1, generator=generator)
        cycles = frequency * t + phase
        fraction = cycles - cycles.floor()
        shapes = torch.stack(
            [
                torch.sin(2 * math.pi * cycles),
                torch.sign(torch.sin(2 * math.pi * cycles)),
                2 * fraction - 1,
                4 * (fraction - 0.5).abs() - 1,
            ]
        )
        waves = shapes[self.labels, torch.arange(count)]
        self.waves = (waves + 0.3 * torch.randn(count, length, generator=generator)).unsqueeze(1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if DELAY_S:
            time.sleep(DELAY_S)
        return self.waves[i], self.labels[i]


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(1, 16, 7, padding=3),
        nn.ReLU(),
        nn.MaxPool1d(2),
        nn.Conv1d(16, 32, 5, padding=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool1d(8),
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.Linear(32 * 8, Waveforms.kinds),
    )

"""Your own training loop under overlapkit: a 1-D CNN that tells waveforms apart.

The model, the data and the loop are all yours; overlapkit adds the events
that optimizations hook into, the phase timings, the summary, multi-rank
gradient sync, and save/resume.

    python examples/custom_loop.py --steps 60 --out runs/waves
    torchrun --standalone --nproc-per-node 2 examples/custom_loop.py --out runs/waves2
    python examples/custom_loop.py --steps 90 --out runs/waves --resume   # continues at step 60
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import overlapkit


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
        nn.Linear(32 * 8, Waveforms.kinds),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("runs/waves"))
    parser.add_argument("--resume", action="store_true", help="continue from --out/checkpoint")
    args = parser.parse_args()

    torch.manual_seed(0)
    session = overlapkit.Session(
        # Optimizations plug in here, e.g. overlapkit.get_optimization("ddp_overlap")(0.5)
        optimizations=[],
        warmup_steps=3,
        run_dir=args.out,
        progress=True,
        print_summary=True,
        name="waveforms",
    )
    world = session.world
    train_set, test_set = Waveforms(2048, seed=1), Waveforms(512, seed=2)
    sampler = DistributedSampler(train_set, world.world_size, world.rank, seed=0)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler, drop_last=True)
    test_loader = DataLoader(
        test_set,
        batch_size=128,
        sampler=DistributedSampler(test_set, world.world_size, world.rank, shuffle=False),
    )
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    if args.resume:
        session.load(args.out / "checkpoint")

    loss_fn = nn.CrossEntropyLoss()
    for waves, labels in session.steps(args.steps):
        with session.forward():
            loss = loss_fn(model(waves), labels)
        session.backward(loss)
        session.optimizer_step()

    session.save(args.out / "checkpoint")
    result = session.evaluate(test_loader)
    summary = session.finish()
    if world.is_main:
        print(
            json.dumps(
                {
                    "step": session.state.step,
                    "accuracy": result["accuracy"],
                    "samples_per_s": summary["samples_per_s"],
                }
            )
        )


if __name__ == "__main__":
    main()

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
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import overlapkit
from waves import Waveforms, make_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("runs/waves"))
    parser.add_argument("--resume", action="store_true", help="continue from --out/checkpoints")
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
        session.load(args.out / "checkpoints")  # the newest checkpoint there

    loss_fn = nn.CrossEntropyLoss()
    for waves, labels in session.steps(args.steps):
        with session.forward():
            loss = loss_fn(model(waves), labels)
        session.backward(loss)
        session.optimizer_step()

    session.save()  # into run_dir/checkpoints
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

"""A classic epoch-loop training script, written plainly (no overlapkit).

Epochs, DistributedSampler.set_epoch, a StepLR stepped per epoch, a test pass
and the best accuracy after every epoch, a checkpoint every epoch and --resume.
examples/epochs_overlapkit.py is this script ported to overlapkit.

    python examples/epochs_plain.py --epochs 4 --out runs/plain
    torchrun --standalone --nproc-per-node 2 examples/epochs_plain.py --out runs/plain2
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from waves import Waveforms, make_model


def train(model, loader, optimizer, epoch, log_every):
    model.train()
    for batch, (waves, labels) in enumerate(loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(waves), labels)
        loss.backward()
        optimizer.step()
        if batch % log_every == 0:
            print(f"epoch {epoch} batch {batch} loss {loss.item():.6f}", flush=True)


def test(model, loader):
    model.eval()
    counts = torch.zeros(2)
    with torch.no_grad():
        for waves, labels in loader:
            counts += torch.tensor([(model(waves).argmax(1) == labels).sum(), len(labels)])
    if dist.is_initialized():
        dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def unwrap(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


def save_checkpoint(path, model, optimizer, scheduler, epoch, best_acc):
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}
    state.update(scheduler=scheduler.state_dict(), epoch=epoch, best_acc=best_acc)
    torch.save(state, path)


def load_checkpoint(path, model, optimizer, scheduler):
    state = torch.load(path)
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["epoch"] + 1, state["best_acc"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/epochs"))
    parser.add_argument("--resume", action="store_true", help="continue from --out/last.pt")
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(args.seed)
    train_set, test_set = Waveforms(2048, seed=1), Waveforms(512, seed=2)
    sampler = DistributedSampler(train_set, world, rank, seed=args.seed) if distributed else None
    loader = DataLoader(
        train_set, batch_size=32, shuffle=sampler is None, sampler=sampler, drop_last=True
    )
    test_sampler = DistributedSampler(test_set, world, rank, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=128, sampler=test_sampler)
    model = make_model()
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = StepLR(optimizer, step_size=2, gamma=0.5)

    last = args.out / "last.pt"
    start_epoch, best_acc = 0, 0.0
    if args.resume and last.exists():
        start_epoch, best_acc = load_checkpoint(last, model, optimizer, scheduler)
    for epoch in range(start_epoch, args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        train(model, loader, optimizer, epoch, args.log_every)
        accuracy = test(model, test_loader)
        scheduler.step()
        best_acc = max(best_acc, accuracy)
        if rank == 0:
            save_checkpoint(last, model, optimizer, scheduler, epoch, best_acc)
            print(json.dumps({"epoch": epoch, "accuracy": accuracy, "best_acc": best_acc}))
    if distributed:
        dist.barrier()  # every rank done: a rank that exits early aborts now and then
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

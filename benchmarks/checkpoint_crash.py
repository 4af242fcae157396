"""Crash safety of two-phase checkpointing, by brute force: SIGKILL a training
process at random moments (during snapshots, persists and manifest updates
too), again and again, resuming each time; then check every promise.

After each kill: the newest checkpoint in the manifest loads and matches its
checksums, and at most two checkpoint intervals of work were lost. At the
end, the run is completed and its parameters must equal, bit for bit, those
of a run that was never interrupted.

    python benchmarks/checkpoint_crash.py --kills 300       # the stress run
    python benchmarks/checkpoint_crash.py --train DIR ...   # one training process (used by the above)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _cli import description, positive_int

BATCH = 16


def train(folder: Path, steps: int, every: int) -> None:
    """Train, printing 'done S' after each step; resumes from the folder's checkpoints."""
    from torch import nn

    from overlapkit import Session, get_optimization
    from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages
    from overlapkit.runtime.rng import seed_everything

    seed_everything(0)
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(192, 768),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(768, 768),
        nn.ReLU(),
        nn.Linear(768, 4),
    )
    data = SyntheticImages((3, 8, 8), num_classes=4, num_samples=200, seed=0)
    loader = ResumableLoader(data, BATCH, ShardedSampler(len(data), seed=0))
    checkpoint = get_optimization("checkpoint")(every=every, keep=2)
    session = Session([checkpoint], device="cpu", run_dir=folder)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    model, optimizer, _ = session.prepare(model, optimizer, loader)
    for inputs, targets in session.steps(steps):
        with session.forward():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        session.backward(loss)
        session.optimizer_step()
        session.end_step()
        print(f"done {session.state.step}", flush=True)  # steps completed
    session.finish()


def newest_checkpoint(folder: Path) -> tuple[int | None, str | None]:
    """The newest checkpoint in the manifest, after checking that it loads."""
    from overlapkit.optimizations.checkpoint.store import Manifest, load_state, verify

    root = folder / "checkpoints"
    entries = Manifest(root).read()
    if not entries:
        return None, "no checkpoint in the manifest"
    entry = entries[-1]
    problem = verify(root, entry, list(entry["files"]))
    if problem:
        return entry["step"], problem
    for name in entry["files"]:
        load_state(root, entry["step"], name)
    return entry["step"], None


class Zygote:
    """One process that imports torch and overlapkit once, then forks each training
    process from itself: a kill costs a fork, not an interpreter start and the
    imports (~2.5 s on 2 cores). The children are ordinary processes: real files,
    real SIGKILLs. Nothing computes in the zygote, so forking it is safe."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.ask("") == "ready"

    def ask(self, line: str) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        if line:
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def start(self, folder: Path, steps: int, every: int) -> Child:
        folder.mkdir(parents=True, exist_ok=True)
        log = folder.parent / f"{folder.name}.log"
        log.write_text("")
        pid = int(self.ask(f"train {folder} {steps} {every} {log}"))
        return Child(self, pid, log)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


class Child:
    """A training process forked by the `Zygote`; its output goes to ``log``."""

    def __init__(self, zygote: Zygote, pid: int, log: Path) -> None:
        self.zygote, self.pid, self.log = zygote, pid, log

    def wait_for_steps(self, count: int, timeout_s: float = 120) -> None:
        """Wait until the child printed ``count`` 'done' lines (an error if it exits)."""
        deadline = time.monotonic() + timeout_s
        while self.log.read_text().count("done ") < count:
            if time.monotonic() > deadline or self.exited():
                raise RuntimeError(f"training exited early: {self.log.read_text()[-2000:]}")
            time.sleep(0.01)

    def exited(self) -> bool:
        return self.zygote.ask(f"poll {self.pid}") != "running"

    def wait(self) -> str:
        return self.zygote.ask(f"wait {self.pid}")

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.wait()

    def done_lines(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if line.startswith("done ")]


def zygote_main() -> None:
    """The zygote's loop: ``train FOLDER STEPS EVERY LOG`` forks a child (answers its
    pid), ``poll PID`` and ``wait PID`` answer running or its exit status."""
    import torch._dynamo  # noqa: F401  (an optimizer's first __init__ imports it: 1.5 s)

    import overlapkit.data  # noqa: F401  (what train() imports, imported once)
    import overlapkit.optimizations.checkpoint  # noqa: F401

    print("ready", flush=True)
    for line in sys.stdin:
        word, *rest = line.split()
        if word == "train":
            folder, steps, every, log = rest
            pid = os.fork()
            if pid == 0:
                out = os.open(log, os.O_WRONLY | os.O_APPEND)
                os.dup2(out, 1)
                os.dup2(out, 2)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                code = 0
                try:
                    train(Path(folder), int(steps), int(every))
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    code = 1
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            print(pid, flush=True)
        else:
            pid, options = int(rest[0]), os.WNOHANG if word == "poll" else 0
            done, status = os.waitpid(pid, options)
            print("running" if done == 0 else f"exited {status}", flush=True)


def kill_loop(
    folder: Path, kills: int, every: int = 2, seed: int = 0, max_delay_s: float = 0.4
) -> dict[str, Any]:
    """Kill and resume ``kills`` times, then finish and compare with an uninterrupted run."""
    rng = random.Random(seed)
    stats: dict[str, Any] = {"kills": 0, "mid_persist": 0, "unloadable": [], "max_lost_steps": 0}
    progress = 0
    zygote = Zygote()
    try:
        for _ in range(kills):
            child = zygote.start(folder, 10**6, every)
            # Wait until training runs (and, the first time, a checkpoint can exist).
            child.wait_for_steps(max(1, 2 * every + 1 - progress))
            time.sleep(rng.uniform(0.0, max_delay_s))
            child.kill()
            lines = child.done_lines()
            progress = max(progress, int(lines[-1].split()[1]) if lines else progress)
            stats["kills"] += 1
            root = folder / "checkpoints"
            listed = {
                f"step-{e['step']:08d}"
                for e in json.loads((root / "manifest.json").read_text())["checkpoints"]
            }
            on_disk = {p.name for p in root.glob("step-*")}
            if on_disk - listed or list(root.rglob(".*.tmp-*")):
                stats["mid_persist"] += 1  # killed while a checkpoint was being written
            step, problem = newest_checkpoint(folder)
            if problem or step is None:
                stats["unloadable"].append(problem)
                continue
            stats["max_lost_steps"] = max(stats["max_lost_steps"], progress - step)
            progress = step  # the next process resumes here
        final_steps = progress + 2 * every
        zygote.start(folder, final_steps, every).wait()
        reference = folder.parent / f"{folder.name}-reference"
        zygote.start(reference, final_steps, every).wait()
    finally:
        zygote.close()
    from overlapkit.optimizations.checkpoint.fileformat import read as read_checkpoint

    a = read_checkpoint(folder / "checkpoints" / f"step-{final_steps:08d}" / "shared.ckpt")
    b = read_checkpoint(reference / "checkpoints" / f"step-{final_steps:08d}" / "shared.ckpt")
    stats["final_step"] = final_steps
    stats["bitwise_equal_to_uninterrupted"] = all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"]
    )
    stats["every"] = every
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--train", type=Path, help="run one training process in this folder")
    parser.add_argument("--zygote", action="store_true", help="fork training processes (internal)")
    parser.add_argument(
        "--steps", type=positive_int, default=10**6, help="with --train: steps to train"
    )
    parser.add_argument("--every", type=positive_int, default=2, help="steps between checkpoints")
    parser.add_argument("--kills", type=int, default=300, help="SIGKILLs to deliver")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path("runs/checkpoint-crash"),
        help="each stress run makes a timestamped folder here",
    )
    args = parser.parse_args()
    if args.zygote:
        zygote_main()
        return
    if args.train is not None:
        train(args.train, args.steps, args.every)
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    folder = args.dir / time.strftime("%Y%m%d-%H%M%S")
    stats = kill_loop(folder, args.kills, args.every)
    print(json.dumps(stats, indent=2))
    ok = not stats["unloadable"] and stats["max_lost_steps"] <= 2 * args.every
    ok = ok and stats["bitwise_equal_to_uninterrupted"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

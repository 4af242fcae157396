"""The Python API over a script's own epoch loop: session.start(), the prepared loader
as an epoch of steps, the script's own backward and optimizer calls, its own DataLoader
resumed exactly, plain values, session.paused(), save/load in one format."""

import json
import shutil
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from conftest import ROOT, free_port
from overlapkit import Session, get_optimization
from overlapkit.data import ScriptLoader
from overlapkit.optimizations.checkpoint.store import CheckpointError, Manifest
from overlapkit.runtime.script import LoopWarning

Checkpoint = get_optimization("checkpoint")


def parts(seed=0, samples=40, batch=8, **loader_kwargs):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = TensorDataset(torch.randn(samples, 6), torch.randint(3, (samples,)))
    loader = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True, **loader_kwargs)
    return model, optimizer, loader


def one_epoch(model, loader, optimizer, stop_after=None):
    """A script's own loop body: plain model(x), loss.backward(), optimizer.step()."""
    losses = []
    for i, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if stop_after is not None and i + 1 == stop_after:
            break
    return losses


# ------------------------------------------------------------- the script's loader
@pytest.mark.parametrize(
    "workers", [{}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": True}]
)
def test_a_dataloader_resumes_mid_epoch_in_the_scripts_own_order(workers):
    """The global RNG draws of each epoch (the workers' seed, RandomSampler's shuffle)
    and the training's own draws (dropout here: torch.rand) interleave as in the
    plain script, through a stop and a resume in a later epoch."""

    def run(wrap, state=None, stop=None):
        torch.manual_seed(0)
        data = TensorDataset(torch.arange(50.0))
        loader = DataLoader(data, batch_size=4, shuffle=True, drop_last=True, **workers)
        loader = wrap(loader)
        seen = []
        if state is not None:
            loader.load_state_dict(state[0])
            torch.set_rng_state(state[1])
        for _epoch in range(loader.epoch if state else 0, 3):
            for (x,) in loader:
                seen.append((x.tolist(), torch.rand(1).item()))
                if len(seen) == stop:
                    return seen, (loader.state_dict(), torch.get_rng_state())
        return seen, None

    plain, _ = run(lambda loader: loader)
    wrapped, _ = run(ScriptLoader)
    assert wrapped == plain  # nothing changes without a resume
    first, saved = run(ScriptLoader, stop=17)  # epoch 1 (12 batches an epoch), batch 5
    assert saved[0]["epoch"] == 1 and saved[0]["position"] == 5
    rest, _ = run(ScriptLoader, state=saved)
    assert first + rest == plain


class Augmented(torch.utils.data.Dataset):
    """Random augmentation in the workers: torch's, random's and numpy's draws."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        import random

        import numpy

        return torch.tensor([i + torch.rand(1).item(), random.random(), numpy.random.rand()])


def mixup(samples):  # a collate function that draws too
    batch = torch.utils.data.default_collate(samples)
    return batch * torch.rand(1)


def seed_numpy_from_the_worker_info(worker_id):  # as torch's documentation suggests
    import numpy

    numpy.random.seed(torch.utils.data.get_worker_info().seed % 2**32)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("stop", [13, 17, 30])  # epoch 1: batch 1 (< the workers), 5, 6
def test_random_draws_in_workers_resume_exactly(persistent, stop):
    """Batch i goes to worker i mod 2; a resume skipping batches by index gives the
    new workers other roles and none of the skipped draws: they start from the
    states the run's workers had (saved with the position), through the rest of the
    epoch and the next (persistent workers are started again with the roles of a
    new epoch)."""

    def run(state=None):
        torch.manual_seed(0)
        loader = ScriptLoader(
            DataLoader(
                Augmented(),
                batch_size=4,
                shuffle=True,
                drop_last=True,
                num_workers=2,
                persistent_workers=persistent,
                collate_fn=mixup,
                worker_init_fn=seed_numpy_from_the_worker_info,
            )  # fmt: skip
        )
        seen = []
        if state is not None:
            loader.load_state_dict(state[0])
            torch.set_rng_state(state[1])
        for _epoch in range(loader.epoch if state else 0, 3):
            for batch in loader:
                seen.append(batch)
                if len(seen) == stop and state is None:
                    saved = (loader.state_dict(), torch.get_rng_state())
        loader.close()
        return seen, saved if state is None else None

    plain, saved = run()
    rest, _ = run(saved)
    assert len(rest) == len(plain) - stop
    for a, b in zip(rest, plain[stop:], strict=True):
        assert torch.equal(a, b)


def test_the_scripts_set_epoch_is_kept_and_restored():
    from torch.utils.data.distributed import DistributedSampler

    data = TensorDataset(torch.arange(16.0))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=3)
    loader = ScriptLoader(DataLoader(data, batch_size=4, sampler=sampler))
    orders = []
    for epoch in range(2):
        sampler.set_epoch(epoch)  # the script's own call
        orders.append([x.tolist() for (x,) in loader])
    assert orders[0] != orders[1]
    sampler.set_epoch(1)
    iterator = iter(loader)
    next(iterator)
    saved = loader.state_dict()
    again = ScriptLoader(
        DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 1, 0, seed=3))
    )
    again.load_state_dict(saved)
    assert [x.tolist() for (x,) in again] == orders[1][1:]


def own_resume_script(run_dir, own_resume, stop_at=None):
    """pytorch/examples' ddp-tutorial-series Trainer (one rank): set_epoch each epoch;
    with ``own_resume`` it still starts at the epoch of its own snapshot file (0 here,
    saved at each epoch's end), not at start.epoch."""
    from torch.utils.data.distributed import DistributedSampler

    model, optimizer, _ = parts()
    data = TensorDataset(torch.randn(40, 6), torch.randint(3, (40,)))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=1)
    loader = DataLoader(data, batch_size=8, sampler=sampler)  # 5 batches an epoch
    session = Session([Checkpoint(every=100)], run_dir=run_dir)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    start = session.start()
    for epoch in range(0 if own_resume else start.epoch, 3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if session.state.step == stop_at:
                session.finish()  # its final checkpoint, mid-way through epoch 1
                return None, None
    summary = session.finish()
    return summary, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("own_resume", [False, True])
def test_a_script_still_resuming_its_own_epoch_count_is_told(tmp_path, own_resume):
    """A port that kept the script's own resume (its epoch loop at its snapshot file's
    epoch) set its sampler to another epoch than the resumed pass had: that pass came
    in another order and whole epochs were trained again, silently. Now a LoopWarning
    and a note; one resume (start.epoch) is exact and told nothing."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", LoopWarning)
        _, straight = own_resume_script(tmp_path / "a", own_resume=False)
        own_resume_script(tmp_path / "b", own_resume, stop_at=7)
        summary, resumed = own_resume_script(tmp_path / "b", own_resume)
    told = [w for w in said if "set_epoch" in str(w.message)]
    notes = [n for n in summary.get("notes", []) if "set_epoch" in n]
    if not own_resume:
        assert torch.equal(resumed, straight) and not told and not notes
        return
    assert not torch.equal(resumed, straight)  # what it is told about
    assert len(told) == 1 and len(notes) == 1
    assert "set its sampler's epoch to 0" in notes[0] and "had set to 1" in notes[0]
    assert told[0].filename == __file__


def test_steps_sets_the_epoch_of_a_prepared_loaders_distributed_sampler():
    """steps() owns the epoch loop: each epoch its own shuffle (was epoch 0's, always)."""
    from torch.utils.data.distributed import DistributedSampler

    data = TensorDataset(torch.arange(16.0))
    session = Session()
    sampler = DistributedSampler(data, num_replicas=1, rank=0)
    session.prepare(nn.Linear(1, 1), None, DataLoader(data, batch_size=4, sampler=sampler))
    seen = [x.tolist() for (x,) in session.steps(8)]
    assert seen[:4] != seen[4:] and sorted(sum(seen[4:], [])) == list(range(16))
    assert sampler.epoch == 1


# ------------------------------------------------------------------ epoch loops
@pytest.mark.slow
def test_epoch_loop_with_a_kill_free_resume_matches_an_uninterrupted_one(tmp_path):
    """start() resumes before the script's epoch loop; a per-epoch StepLR and a plain
    best value come back; the continued run equals the uninterrupted one bit for bit."""

    def script(run_dir, epochs, stop_in_epoch=None):
        model, optimizer, loader = parts()
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        session = Session([Checkpoint(every=2)], run_dir=run_dir)
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        best = -1.0
        start = session.start(schedule=schedule, best=lambda: best)
        best = start.values["best"]
        losses = []
        for epoch in range(start.epoch, epochs):
            stop = 3 if epoch == stop_in_epoch else None
            losses += one_epoch(model, loader, optimizer, stop_after=stop)
            if stop:
                break
            schedule.step()
            best = max(best, -losses[-1])
        session.finish()
        return start, losses, best, model, schedule

    _, straight, best, model, schedule = script(tmp_path / "a", 3)
    first_start, before, _, _, _ = script(tmp_path / "b", 3, stop_in_epoch=1)
    assert first_start.resumed_from is None
    start, after, best_again, model_again, schedule_again = script(tmp_path / "b", 3)
    # 5 batches an epoch; the break after batch 3 of epoch 1 wrote a final checkpoint.
    assert (start.step, start.epoch, start.batch) == (8, 1, 3)
    assert start.resumed_from.endswith("step-00000008")
    assert before + after == straight and best_again == best
    assert schedule_again.state_dict() == schedule.state_dict()
    for a, b in zip(model.parameters(), model_again.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_break_closes_the_step_and_finish_writes_the_final_checkpoint(tmp_path):
    model, optimizer, loader = parts()
    session = Session([Checkpoint(every=1000)], run_dir=tmp_path)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    one_epoch(model, loader, optimizer, stop_after=2)
    summary = session.finish()
    assert [r["step"] for r in session.records] == [0, 1]
    assert summary["optimizations"]["checkpoint"]["checkpoints"] == 1
    manifest = json.loads((tmp_path / "checkpoints" / "manifest.json").read_text())
    assert [c["step"] for c in manifest["checkpoints"]] == [2]


def test_a_break_in_each_epoch_makes_the_next_pass_a_new_epoch(tmp_path):
    """A script training the first batches of each epoch (a dry run, a batch limit):
    each pass over the prepared loader is a freshly shuffled epoch, as over the
    script's own DataLoader (it continued the left epoch). A save after a break
    resumes where the pass was left (a break to save and stop looks the same)."""

    def script(prepare, run_dir=None, epochs=3, save=False):
        model, optimizer, loader = parts(samples=48)
        session = None
        if prepare:
            session = Session([Checkpoint(every=2, final=not save)], run_dir=run_dir)
            model, optimizer, loader = session.prepare(model, optimizer, loader)
        start = session.start() if session else None
        seen = []
        for _epoch in range(start.epoch if start else 0, epochs):
            for i, (x, _y) in enumerate(loader):
                seen.append(x.sum().item())
                optimizer.zero_grad()
                model(x).sum().backward()
                optimizer.step()
                if i + 1 == 2:
                    break
        if save:
            session.save()
        if session is not None:
            session.finish()
        return start, seen

    _, plain = script(False)
    _, ported = script(True, tmp_path / "a")
    assert ported == plain  # was: the second pass took the first epoch's next batches
    script(True, tmp_path / "b", epochs=2, save=True)
    start, _ = script(True, tmp_path / "b")
    assert (start.step, start.epoch, start.batch) == (4, 1, 2)


def test_an_error_in_the_loop_and_a_save_resume_where_it_stopped(tmp_path):
    """An exception leaving the loop (a preemption signal turned into one) and a save
    in its handler: the resume continues the epoch there and equals the run never
    stopped (the exception's close of the pass is no break to a new epoch)."""

    def script(run_dir, fail_at=None):
        model, optimizer, loader = parts()  # 5 batches an epoch
        session = Session([Checkpoint(every=100, final=False)], run_dir=run_dir)
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        start = session.start()
        try:
            for _epoch in range(start.epoch, 2):
                for x, y in loader:
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    optimizer.step()
                    if session.state.step == fail_at:
                        raise KeyboardInterrupt
        except KeyboardInterrupt:
            session.save()
            session.finish()
            return start, None
        session.finish()
        return start, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    _, straight = script(tmp_path / "a")
    script(tmp_path / "b", fail_at=7)  # epoch 1, after its third batch
    start, resumed = script(tmp_path / "b")
    assert (start.step, start.epoch, start.batch) == (8, 1, 3)
    assert torch.equal(resumed, straight)


def test_a_peek_at_one_batch_takes_nothing_from_the_epoch(tmp_path):
    """``next(iter(loader))`` for a shape, then the epoch loop: the loop gets the same
    batches as the plain script's; after a resume mid-epoch, the peek takes nothing
    from the rest of the epoch (it took the rest: the run lost it)."""

    def script(prepare, run_dir=None, stop_at=None):
        model, optimizer, loader = parts()  # 5 batches an epoch
        session = None
        if prepare:
            session = Session([Checkpoint(every=100, final=False)], run_dir=run_dir)
            model, optimizer, loader = session.prepare(model, optimizer, loader)
        start = session.start() if session else None
        next(iter(loader))  # the script looks at a batch's shape
        seen = []
        for _epoch in range(start.epoch if start else 0, 2):
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                seen.append(x.sum().item())
                if stop_at is not None and len(seen) == stop_at:
                    session.save()
                    session.finish()
                    return seen
        if session is not None:
            session.finish()
        return seen

    plain = script(False)
    assert script(True, tmp_path / "a") == plain
    first = script(True, tmp_path / "b", stop_at=7)
    assert first + script(True, tmp_path / "b") == plain
    # A list of batches: the peek counts no epoch (the resume started an epoch late).
    batches = [(torch.randn(4, 6), torch.randint(3, (4,))) for _ in range(3)]
    session = Session([Checkpoint(every=100)], run_dir=tmp_path / "list")
    model, optimizer, _ = parts()
    model, optimizer, loader = session.prepare(model, optimizer, batches)
    next(iter(loader))
    one_epoch(model, loader, optimizer)
    session.finish()
    again = Session([Checkpoint(every=100)], run_dir=tmp_path / "list")
    again.prepare(*parts()[:2], batches)
    assert again.start().epoch == 1  # one epoch trained
    again.finish()


def test_a_peek_in_every_epoch_is_no_step(tmp_path):
    """pytorch/examples' ddp-tutorial-series Trainer looks at a batch's size at the
    start of every epoch (``len(next(iter(self.train_data))[0])``). Each look was a
    step: the summary noted "24 steps and 20 optimizer steps" of a loop with one
    update per batch, and a run resumed mid-epoch made its epoch's look again, so it
    ended a step later than the run never stopped."""

    def script(run_dir, stop_at=None):
        model, optimizer, loader = parts()  # 5 batches an epoch
        session = Session([Checkpoint(every=3)], run_dir=run_dir)
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        start = session.start()
        for _epoch in range(start.epoch, 4):
            assert len(next(iter(loader))[0]) == 8  # the script's look at the batch size
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                if session.state.step + 1 == stop_at:
                    session.save()
                    session.finish()
                    return None, None
        summary = session.finish()
        return summary, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    summary, straight = script(tmp_path / "a")
    assert summary["steps"] == 20 and session_step(tmp_path / "a") == 20
    assert not [n for n in summary.get("notes", []) if "optimizer steps" in n]
    script(tmp_path / "b", stop_at=12)  # epoch 2, after its second batch
    resumed_summary, resumed = script(tmp_path / "b")
    assert torch.equal(resumed, straight)
    assert session_step(tmp_path / "b") == 20  # was 21: the resumed epoch's look again


def session_step(run_dir):
    """The step of the run's newest checkpoint (its final one)."""
    return Manifest(run_dir / "checkpoints").read()[-1]["step"]


def test_a_break_with_persistent_workers_is_said_to_resume_inexactly(tmp_path):
    """Persistent workers had loaded batches ahead when the pass was left: their draws
    never come back to be saved, so a resume's workers would draw otherwise."""
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Augmented(), batch_size=4, num_workers=2, persistent_workers=True)
    session = Session([Checkpoint(every=100)], run_dir=tmp_path)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    for _epoch in range(2):
        for i, x in enumerate(loader):
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
            if i == 2:
                break
    summary = session.finish()
    assert any("persistent workers" in n for n in summary["notes"]), summary.get("notes")


def test_a_resume_before_the_scripts_schedule_step_gives_no_false_torch_warning(tmp_path):
    """The checkpoint of step 5 is taken at the step the session opens at epoch 0's
    end, before the script's scheduler.step(): resumed there, the script's first call
    is that step, and torch warned that the optimizer never stepped (it had, 5 times,
    before the checkpoint)."""

    def script(epochs, stop=False):
        model, optimizer, loader = parts()  # 5 batches an epoch
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        session = Session([Checkpoint(every=5, final=False)], run_dir=tmp_path)
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        start = session.start(schedule=schedule)
        for _epoch in range(start.epoch, epochs):
            one_epoch(model, loader, optimizer)
            if stop:
                break
            schedule.step()
        session.finish()

    script(1, stop=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        script(1)


def test_a_loader_without_a_position_resumes_after_a_whole_epoch_at_the_next(tmp_path):
    """An iterable the script makes has no position: a run resumed at an epoch's end
    starts the next epoch (it started epoch 0 again: a whole run trained twice)."""

    class Batches:  # a script's own iterable: neither a sequence nor a DataLoader
        def __init__(self):
            self.batches = [(torch.randn(4, 6), torch.randint(3, (4,))) for _ in range(4)]

        def __iter__(self):
            return iter(self.batches)

        def __len__(self):
            return len(self.batches)

    def script(epochs):
        model, optimizer, _ = parts()
        session = Session([Checkpoint(every=2)], run_dir=tmp_path)
        model, optimizer, loader = session.prepare(model, optimizer, Batches())
        start = session.start()
        for _epoch in range(start.epoch, epochs):
            one_epoch(model, loader, optimizer)
        session.finish()
        return start, session.records

    script(2)
    start, records = script(3)
    assert (start.step, start.epoch, start.batch) == (8, 2, 0)
    assert [r["step"] for r in records] == [8, 9, 10, 11]


class Crash(Exception):
    """Where a test's script stops as if killed (its checkpoints persisted)."""


@pytest.mark.parametrize("kind", [list, tuple])
@pytest.mark.parametrize("crash", ["in epoch 1's evaluation", "at step 7"])
def test_a_list_of_batches_resumes_at_its_position(tmp_path, kind, crash):
    """A list of batches had no position: a run resumed mid-epoch started the epoch
    again, and one checkpointed as the epoch's batches ran out (before the script's
    end-of-epoch code: an evaluation, a learning rate annealed by hand) resumed at the
    next epoch, skipping that code (pytorch/examples' word_language_model: its lr
    stayed 4 times too large, silently). The same items come in the same order every
    epoch: the position is all a resume needs; and a checkpoint due as an epoch runs
    out is taken at the next step's start, after the script's end-of-epoch code."""
    torch.manual_seed(1)
    batches = kind((torch.randn(4, 6), torch.randint(3, (4,))) for _ in range(4))

    def script(run_dir, crash_at=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 3))
        session = Session([Checkpoint(every=4 if crash_at == "eval" else 3, final=False)],
                          run_dir=run_dir)  # fmt: skip
        model, _, loader = session.prepare(model, None, batches)
        lr, evaluated = 0.1, []
        start = session.start(lr=lambda: lr, evaluated=lambda: evaluated)
        lr, evaluated = start.values["lr"], start.values["evaluated"]
        resumed_with = (lr, list(evaluated))
        try:
            for epoch in range(start.epoch, 3):
                for x, y in loader:
                    loss = nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    with torch.no_grad():
                        for p in model.parameters():
                            p -= lr * p.grad
                            p.grad = None
                    if crash_at == session.state.step:
                        raise Crash
                with session.paused():
                    if crash_at == "eval" and epoch == 1:
                        raise Crash
                    evaluated.append(epoch)
                lr /= 4
        except Crash:
            pass
        session.finish()
        return model, lr, evaluated, start, resumed_with

    straight, lr, evaluated, *_ = script(tmp_path / "a")
    script(tmp_path / "b", "eval" if "evaluation" in crash else 7)
    model, lr_b, evaluated_b, start, resumed_with = script(tmp_path / "b")
    assert (start.epoch, start.batch, start.step) == ((1, 0, 4) if "eval" in crash else (1, 2, 6))
    assert resumed_with == (0.1 / 4, [0])  # after epoch 0's evaluation and anneal
    assert (lr_b, evaluated_b) == (lr, evaluated) == (0.1 / 64, [0, 1, 2])
    for a, b in zip(straight.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def manual_sgd(model, lr=0.1):
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None


@pytest.mark.parametrize("through", ["the list given to prepare", "the loader it returned"])
def test_the_list_given_to_prepare_iterated_through_the_session_keeps_its_position(
    tmp_path, through
):
    """session.epoch(batches) over the list given to prepare iterated the list itself:
    the prepared loader never moved, and its (epoch 0, batch 0) was saved: a resume
    trained two epochs again."""
    torch.manual_seed(1)
    batches = [(torch.randn(4, 6), torch.randint(3, (4,))) for _ in range(4)]

    def script(run_dir, crash_at=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        session = Session([Checkpoint(every=3, final=False)], run_dir=run_dir)
        model, _, loader = session.prepare(model, None, batches)
        start = session.start()
        try:
            for _epoch in range(start.epoch, 3):
                for x, y in session.epoch(batches) if "prepare" in through else loader:
                    nn.functional.cross_entropy(model(x), y).backward()
                    manual_sgd(model)
                    if session.state.step == crash_at:
                        raise Crash
        except Crash:
            pass
        summary = session.finish()
        return model, start, summary

    straight, _, _ = script(tmp_path / "a")
    script(tmp_path / "b", crash_at=10)
    model, start, summary = script(tmp_path / "b")
    assert (start.step, start.epoch, start.batch) == (9, 2, 1)
    assert summary["steps"] == 12 - 9
    for a, b in zip(straight.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_list_saved_without_a_position_resumes_at_its_epoch(tmp_path, monkeypatch):
    """Checkpoints of a list from before it had a position hold no loader state: the
    list stayed at epoch 0, and a resume trained the whole run again."""
    from overlapkit.data import SequenceLoader

    batches = [(torch.randn(4, 6), torch.randint(3, (4,))) for _ in range(4)]

    def script(epochs):
        model, optimizer, _ = parts()
        session = Session([Checkpoint(every=2)], run_dir=tmp_path)
        model, optimizer, loader = session.prepare(model, optimizer, batches)
        start = session.start()
        for _epoch in range(start.epoch, epochs):
            one_epoch(model, loader, optimizer)
        return start, session.finish()

    with monkeypatch.context() as old:
        old.delattr(SequenceLoader, "state_dict")  # saved as an older version did
        script(2)
    start, summary = script(3)
    assert (start.step, start.epoch, start.batch) == (8, 2, 0)
    assert summary["steps"] == 4


def test_a_break_after_a_batch_trained_by_hand_is_a_step(tmp_path):
    """Without an optimizer nothing counted the batch as trained: a break after one
    batch was taken for a look at it (next(iter(loader))), and no step was counted,
    checkpointed or logged."""
    model = nn.Sequential(nn.Linear(6, 3))
    batches = [(torch.randn(4, 6), torch.randint(3, (4,))) for _ in range(4)]
    session = Session([Checkpoint(every=1)], run_dir=tmp_path)
    model, _, loader = session.prepare(model, None, batches)
    for _epoch in range(3):
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            manual_sgd(model)
            break
    summary = session.finish()
    assert summary["steps"] == 3 and session.state.step == 3
    assert summary["optimizations"]["checkpoint"]["checkpoints"] >= 2


def test_a_checkpoint_due_as_an_epoch_runs_out_waits_for_the_scripts_epoch_end(tmp_path):
    """It was taken at the step that found the loader empty, before the script's
    evaluation: resumed, the pass had nothing left, so the DDP tutorial's look at a
    batch (next(iter(loader))) raised StopIteration, and the sampler's epoch, set by
    the script for the next pass, was told as a script resuming twice."""
    from torch.utils.data.distributed import DistributedSampler

    data = TensorDataset(torch.randn(20, 6), torch.randint(3, (20,)))

    def script(run_dir, crash=False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=3)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
        session = Session([Checkpoint(every=5, final=False)], run_dir=run_dir)
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        start = session.start()
        try:
            for epoch in range(start.epoch, 3):
                assert len(next(iter(loader))[0]) == 4  # the tutorial's look
                sampler.set_epoch(epoch)
                one_epoch(model, loader, optimizer)
                with session.paused():
                    if crash and epoch == 1:
                        raise Crash
        except Crash:
            pass
        return model, start, session.finish()

    straight, _, _ = script(tmp_path / "a")
    script(tmp_path / "b", crash=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoopWarning)
        model, start, summary = script(tmp_path / "b")
    assert (start.step, start.epoch, start.batch) == (5, 1, 0)
    assert not [n for n in summary.get("notes", []) if "cannot resume exactly" in n]
    for a, b in zip(straight.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


class Buckets(torch.utils.data.Sampler):
    """A bucketing batch sampler: 5 batches of 4, its length an estimate (3)."""

    def __iter__(self):
        return iter([list(range(i, i + 4)) for i in range(0, 20, 4)])

    def __len__(self):
        return 3


class EpochShuffled(torch.utils.data.Sampler):
    """Shuffled by its epoch (set_epoch), as DistributedSampler; no length."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        return iter(order.tolist())


@pytest.mark.parametrize("shape", ["len under-reported", "no len", "prefetch, raw loader"])
def test_loaders_with_odd_lengths_or_wrapped_resume_where_they_were(tmp_path, shape):
    """From the review of the end-of-epoch change: a sampler whose length is an
    estimate had a checkpoint count one batch too many (the resume skipped it); one
    with set_epoch but no length failed every resume; and session.epoch(dl) over the
    DataLoader given to prepare, under prefetch, iterated it raw (a resume retrained
    the whole run)."""
    data = TensorDataset(torch.randn(20, 6), torch.randint(3, (20,)))
    Prefetch = get_optimization("prefetch")

    def script(run_dir, crash_at=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = EpochShuffled(20) if shape == "no len" else None
        if shape == "len under-reported":
            loader = DataLoader(data, batch_sampler=Buckets())
        else:
            loader = DataLoader(data, batch_size=4, sampler=sampler, shuffle=sampler is None)
        made = [Checkpoint(every=4, final=False)]
        if shape.startswith("prefetch"):
            made.append(Prefetch(0.5, backend="torch", workers=0))
        session = Session(made, run_dir=run_dir)
        raw = loader
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        start = session.start()
        try:
            for epoch in range(start.epoch, 3):
                if sampler is not None:
                    sampler.set_epoch(epoch)
                for x, y in session.epoch(raw) if shape.startswith("prefetch") else loader:
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    optimizer.step()
                    if session.state.step == crash_at:
                        raise Crash
        except Crash:
            pass
        return model, start, session.finish()

    straight, _, whole = script(tmp_path / "a")
    script(tmp_path / "b", crash_at=6)
    model, start, summary = script(tmp_path / "b")
    assert start.step == 4 and summary["steps"] + 4 == whole["steps"]
    for a, b in zip(straight.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_sampler_whose_length_raises_runs_its_epochs(tmp_path):
    """len() raising other than TypeError (NotImplementedError) ended the first step."""

    class Unknown(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(range(20))

        def __len__(self):
            raise NotImplementedError("length unknown")

    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(20, 6), torch.randint(3, (20,)))
    session = Session([], run_dir=tmp_path)
    model, optimizer, loader = session.prepare(
        model, optimizer, DataLoader(data, batch_size=4, sampler=Unknown())
    )
    assert len(one_epoch(model, loader, optimizer)) == 5
    assert session.finish()["steps"] == 5


def test_a_list_changed_between_epochs_is_said(tmp_path):
    """The position is in the list the resumed script has: one shuffled in place each
    epoch holds other batches there, and one of another length other batches too."""
    import random

    def script(size, epochs):
        model, optimizer, _ = parts()
        batches = [(torch.randn(4, 6), torch.randint(3, (4,))) for _ in range(size)]
        session = Session([Checkpoint(every=3)], run_dir=tmp_path)
        model, optimizer, loader = session.prepare(model, optimizer, batches)
        start = session.start()
        for _epoch in range(start.epoch, epochs):
            random.shuffle(batches)
            one_epoch(model, loader, optimizer)
        return session.finish()

    said = script(4, 2)["notes"]
    assert any("list of batches changed between epochs" in n for n in said), said
    said = script(5, 3)["notes"]
    assert any("has 5 where the checkpointed run's had 4" in n for n in said), said


def test_a_loop_the_session_cannot_see_is_told_not_silent(tmp_path):
    model, optimizer, loader = parts()
    session = Session([Checkpoint(every=1)], run_dir=tmp_path)
    model, optimizer, _ = session.prepare(model, optimizer, loader)
    with pytest.warns(LoopWarning, match="outside any step"):
        one_epoch(model, loader, optimizer)  # the original loader: no steps
    with pytest.warns(LoopWarning, match="no checkpoint was taken"):
        summary = session.finish()
    assert summary["steps"] == 0
    assert not (tmp_path / "checkpoints" / "manifest.json").exists()


def test_the_scripts_own_calls_fire_every_step_event_and_are_timed():
    from overlapkit import Event, Optimization

    class Events(Optimization):
        name = "events"

        def __init__(self):
            super().__init__(1.0)
            self.seen = []

        def __getattr__(self, hook):
            if not hook.startswith("on_"):
                raise AttributeError(hook)
            return lambda state: self.seen.append(hook.removeprefix("on_"))

    spy = Events()
    model, optimizer, loader = parts()
    session = Session([spy])
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    one_epoch(model, loader, optimizer, stop_after=1)
    summary = session.finish()
    step = spy.seen[spy.seen.index("step_start") : spy.seen.index("step_end") + 1]
    assert step == [e.value for e in Event][1:10]
    for phase in ("forward", "backward", "optimizer"):
        assert summary["phases_s"][phase] > 0, phase


def test_paused_time_is_outside_every_step_and_reported(fake_clock):
    fake_clock.tick = 1e-6  # every reading of the runtime's clock: 1 us
    model, optimizer, loader = parts()
    session = Session()
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if i == 1:
            with session.paused("evaluation"):  # inside a step
                fake_clock.sleep(1.0)
    with session.paused("evaluation"):  # between epochs
        fake_clock.sleep(0.5)
    one_epoch(model, loader, optimizer)
    summary = session.finish()
    # Only the clock's ticks are left beside the pauses: far below a millisecond.
    assert summary["outside_steps_s"]["evaluation"] == pytest.approx(1.5, abs=1e-3)
    assert max(r["step_time_s"] for r in session.records) < 1e-3  # the pause is in no step
    assert summary["outside_steps_s"].get("between_epochs", 0.0) < 1e-3  # nor between epochs


def test_a_pause_inside_another_counts_under_its_own_label_only(fake_clock):
    """outside_steps_s counted a nested pause twice (an 'evaluation' inside a 'rest'
    was in both): the labels added up to more than the time outside the steps."""
    fake_clock.tick = 1e-6
    model, optimizer, loader = parts()
    session = Session()
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    for i, (x, y) in enumerate(loader):
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if i == 1:  # inside a step
            with session.paused("rest"):
                fake_clock.sleep(0.25)
                with session.paused("evaluation"):
                    fake_clock.sleep(1.0)
    with session.paused("rest"):  # between epochs
        with session.paused("evaluation"):
            fake_clock.sleep(0.5)
        fake_clock.sleep(0.125)
    one_epoch(model, loader, optimizer)
    summary = session.finish()
    outside = summary["outside_steps_s"]
    assert outside["evaluation"] == pytest.approx(1.5, abs=1e-3)
    assert outside["rest"] == pytest.approx(0.375, abs=1e-3)
    assert max(r["step_time_s"] for r in session.records) < 1e-3
    assert outside.get("between_epochs", 0.0) < 1e-3


def test_save_and_load_use_the_checkpoint_format_and_folder(tmp_path):
    model, optimizer, loader = parts()
    session = Session([Checkpoint(every=2, keep=10)], run_dir=tmp_path)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    one_epoch(model, loader, optimizer)
    saved = session.save()  # into the optimization's own folder
    assert saved == tmp_path / "checkpoints" / "step-00000005"
    session.finish()

    def fresh():
        session = Session()
        session.prepare(*parts()[:2])
        return session

    assert fresh().load(tmp_path / "checkpoints").step == 5  # the newest
    assert fresh().load(tmp_path / "checkpoints" / "step-00000002").step == 2
    with pytest.raises(CheckpointError, match="no checkpoint in .*manifest.json"):
        fresh().load(tmp_path / "nothing-here")


def test_ddp_overlap_alone_is_off_with_a_note_and_a_ddp_model_is_unwrapped(capfd):
    session = Session([get_optimization("ddp_overlap")(1.0)])
    assert session.scheduler.optimizations == []
    model, optimizer, loader = parts()
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        wrapped = DistributedDataParallel(model)
        session = Session()
        prepared, _, _ = session.prepare(wrapped, optimizer, loader)
        # Unwrapped for the session; the script still holds a DDP-like model (one rank).
        assert prepared.module is model and type(prepared).__name__ == "DDPView"
        session.finish()
    finally:
        dist.destroy_process_group()
    err = capfd.readouterr().err
    assert "ddp_overlap is off" in err and "unwrapped" in err


def test_a_loader_that_cannot_resume_is_said_so_when_checkpointing(tmp_path, capfd):
    class Stream(IterableDataset):
        def __iter__(self):
            return iter([(torch.randn(6), 0)] * 8)

    session = Session([Checkpoint(every=1)], run_dir=tmp_path)
    model, optimizer, _ = parts()
    session.prepare(model, optimizer, DataLoader(Stream(), batch_size=4))
    assert "IterableDataset" in capfd.readouterr().err
    assert any("IterableDataset" in n for n in session.notes)


def test_bf16_needs_the_forward_block_and_values_must_be_checkpointable():
    session = Session(device="cpu", precision="bf16")
    model, optimizer, loader = session.prepare(*parts())
    with pytest.raises(TypeError, match="lambda"):
        session.register_for_checkpointing("best", 0.5)
    with pytest.raises(RuntimeError, match="session.forward"):
        one_epoch(model, loader, optimizer)


# ------------------------------------------------------------------ the examples
PLAIN, PORT = ROOT / "examples" / "epochs_plain.py", ROOT / "examples" / "epochs_overlapkit.py"


def changed_lines(a: str, b: str) -> list[str]:
    """Lines the port changes, past the module docstring and without the lines that
    choose optimizations (marked ``# optimizations``)."""
    import difflib

    def code(text):
        body = text[text.index('"""', 3) + 3 :]
        return [line for line in body.splitlines() if not line.endswith("# optimizations")]

    before, after = code(a), code(b)
    changed = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, before, after).get_opcodes():
        if tag != "equal":
            pairs = max(i2 - i1, j2 - j1)
            changed += (after[j1:j2] + before[i1:i2])[:pairs]
    return changed


def test_the_port_changes_at_most_eight_lines():
    changed = changed_lines(PLAIN.read_text(), PORT.read_text())
    assert 0 < len(changed) <= 8, changed


def run_example(script, out, *args, torchrun=False, env=None, check=True):
    import os
    import subprocess

    prefix = [sys.executable]
    if torchrun:
        prefix += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*prefix, str(script), "--out", str(out), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def final_state(out):
    return torch.load(out / "last.pt")


def assert_same_state(a, b, exact=True):
    assert a["best_acc"] == b["best_acc"] and a["epoch"] == b["epoch"]
    for name, tensor in a["model"].items():
        if exact:
            assert torch.equal(tensor, b["model"][name]), name
        else:
            assert torch.allclose(tensor, b["model"][name], rtol=1e-4, atol=1e-5), name


@pytest.mark.slow
def test_the_port_without_optimizations_is_bit_identical_to_the_plain_script(tmp_path):
    plain = run_example(PLAIN, tmp_path / "plain", "--epochs", 2, "--log-every", 1)
    port = run_example(PORT, tmp_path / "port", "--epochs", 2, "--log-every", 1)
    assert plain.stdout.count("loss") == 128 and port.stdout == plain.stdout  # every loss
    assert_same_state(final_state(tmp_path / "plain"), final_state(tmp_path / "port"))


@pytest.mark.slow
def test_sigkill_mid_epoch_and_the_same_command_again_give_the_uninterrupted_result(tmp_path):
    import os
    import signal
    import subprocess

    args = ["--epochs", 3, "--optimize", "checkpoint", "prefetch", "--intensity", 0.6]
    run_example(PORT, tmp_path / "straight", *args)
    # 0.5 ms per sample: about 16 ms a batch, so the run is surely killed mid-way.
    out = tmp_path / "killed"
    slow = {**os.environ, "WAVES_DELAY_MS": "0.5"}
    command = [sys.executable, str(PORT), "--out", str(out), *map(str, args)]
    victim = subprocess.Popen(command, cwd=ROOT, env=slow, stdout=subprocess.DEVNULL)
    manifest = out / "checkpoints" / "manifest.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and victim.poll() is None:
        try:
            steps = [c["step"] for c in json.loads(manifest.read_text())["checkpoints"]]
        except (OSError, ValueError, KeyError):
            steps = []
        if any(64 < step < 128 and step % 64 for step in steps):  # inside epoch 1
            os.kill(victim.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    assert victim.wait(30) == -signal.SIGKILL
    again = run_example(PORT, out, *args)
    assert "resumed at step" in again.stderr and "(epoch 1, batch" in again.stderr
    assert_same_state(final_state(tmp_path / "straight"), final_state(out))


@pytest.mark.slow
def test_two_ranks_with_ddp_overlap_equal_the_flat_all_reduce(tmp_path):
    flat = run_example(PORT, tmp_path / "flat", "--epochs", 2, torchrun=True)
    run_example(PORT, tmp_path / "ddp", "--epochs", 2, "--optimize", "ddp_overlap", torchrun=True)
    assert "unwrapped" in flat.stderr  # the script's own DDP wrapper
    assert_same_state(final_state(tmp_path / "flat"), final_state(tmp_path / "ddp"), exact=False)
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["world_size"] == 2 and "grad_sync" not in summary  # DDP synced
    assert json.loads((tmp_path / "flat" / "summary.json").read_text())["grad_sync"]


def test_prefetch_keeps_the_scripts_random_draws_across_epochs():
    """prefetch's workers draw the global RNG as the script's own DataLoader does
    (persistent workers drew one base seed a run, not one an epoch: from the second
    epoch on the shuffle and the training's own draws parted from the plain script)."""

    def run(optimizations):
        torch.manual_seed(0)
        data = TensorDataset(torch.arange(20.0).unsqueeze(1), torch.zeros(20, dtype=torch.long))
        loader = DataLoader(data, batch_size=4, shuffle=True)
        model = nn.Linear(1, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        session = None
        if optimizations is not None:
            session = Session(optimizations, progress=False)
            model, optimizer, loader = session.prepare(model, optimizer, loader)
        seen = []
        for _epoch in range(3):
            for x, y in loader:
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                seen.append((x.squeeze(1).tolist(), torch.rand(1).item()))
        if session is not None:
            session.finish()
        return seen

    assert run([get_optimization("prefetch")(0.6)]) == run(None)


def test_prefetch_with_other_workers_than_the_scripts_loader_says_its_draws_differ():
    """torchvision's classification script augments in its DataLoader's workers (a
    random crop and flip per sample, mixup in the collate function): prefetch at
    intensity 1 loaded with 4 workers where the script had 2, so batch 2 came from
    another worker's RNG stream and the port trained to other parameters than the
    plain script, silently. Now a note says so, and workers=2 keeps the draws."""

    def run(prefetch=None):
        model = nn.Linear(3, 1)
        torch.manual_seed(0)
        loader = DataLoader(Augmented(), batch_size=4, num_workers=2, collate_fn=mixup)
        if prefetch is None:
            return [x for x in loader], None
        session = Session([prefetch], progress=False)
        _, _, loader = session.prepare(model, None, loader)
        batches = [x for x in loader]
        return batches, session.finish()["optimizations"]["prefetch"]["notes"]

    plain, _ = run()
    other, notes = run(get_optimization("prefetch")(1.0))
    assert not all(torch.equal(a, b) for a, b in zip(plain, other, strict=True))
    assert any("has 2 workers, prefetch loads with 4" in note for note in notes), notes
    same, notes = run(get_optimization("prefetch")(1.0, workers=2))
    assert all(torch.equal(a, b) for a, b in zip(plain, same, strict=True))
    assert not any("workers" in note and "draws" in note for note in notes), notes
    # Another count given by hand: the same difference, said as well (it was not).
    _, notes = run(get_optimization("prefetch")(1.0, workers=3))
    assert any("has 2 workers, prefetch loads with 3" in note for note in notes), notes


def test_prefetch_over_a_loader_without_workers_advises_what_keeps_its_draws():
    """The script's DataLoader had no workers; the note advised workers=0, but then a
    feeder thread loads ahead and its draws interleave with the training's own (the
    README says so): the run still differs. Only intensity 0 keeps the draws."""

    def run(prefetch=None):
        import random

        import numpy

        model = nn.Linear(3, 1)
        torch.manual_seed(0), random.seed(0), numpy.random.seed(0)
        loader = DataLoader(Augmented(), batch_size=4)
        session = None
        if prefetch is not None:
            session = Session([prefetch], progress=False)
            _, _, loader = session.prepare(model, None, loader)
        seen = []
        for x in loader:
            time.sleep(0.005)  # compute: the feeder loads ahead meanwhile
            seen.append((x.tolist(), torch.rand(1).item()))  # the training's own draw
        return seen, session.finish()["optimizations"]["prefetch"]["notes"] if session else []

    plain, _ = run()
    _, notes = run(get_optimization("prefetch")(1.0))
    assert any("has 0 workers, prefetch loads with 4" in note for note in notes), notes
    assert not any("workers=0) keeps" in note for note in notes), notes
    assert any("only intensity 0 keeps its draws" in note for note in notes), notes
    assert run(get_optimization("prefetch")(0.0))[0] == plain


def test_random_draws_in_prefetch_workers_resume_exactly_with_batches_taken_ahead(tmp_path):
    """prefetch's feeder takes batches ahead of training: the workers' states saved
    are those as of the batches training had, not the ones taken ahead."""

    def run(run_dir, stop_at=None):
        torch.manual_seed(0)
        loader = DataLoader(Augmented(), batch_size=4, shuffle=True, collate_fn=mixup)
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        prefetch = get_optimization("prefetch")(1.0, workers=2, depth=4, device_depth=4)
        session = Session([Checkpoint(every=5, final=False), prefetch], run_dir=run_dir)
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        start = session.start()
        for _epoch in range(start.epoch, 2):
            for x in loader:
                if session.state.step == stop_at:
                    session.finish()
                    return None
                optimizer.zero_grad()
                model(x).square().mean().backward()
                optimizer.step()
        session.finish()
        return model.weight.detach().clone()

    straight = run(tmp_path / "a")
    run(tmp_path / "b", stop_at=8)  # its last checkpoint: step 5, training 3 behind
    assert torch.equal(run(tmp_path / "b"), straight)


def test_a_loop_without_an_optimizer_checkpoints_and_resumes(tmp_path):
    """A script that updates its parameters itself (no torch.optim optimizer, as
    pytorch/examples' word_language_model does) hung at its second checkpoint: the
    snapshot waited for an optimizer step that never came, holding its buffers."""

    def run(folder, stop=None):
        torch.manual_seed(0)
        x = torch.randn(80, 4)
        loader = DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=4)
        model = nn.Linear(4, 2)
        session = Session([Checkpoint(every=4)], run_dir=folder, progress=False)
        model, _, loader = session.prepare(model, None, loader)
        session.start()
        for step, (xb, yb) in enumerate(loader, start=session.state.step):
            model.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)
            if step + 1 == stop:
                break
        summary = session.finish()
        return [p.detach().clone() for p in model.parameters()], summary

    straight, summary = run(tmp_path / "a")
    assert summary["optimizations"]["checkpoint"]["checkpoints"] >= 5
    run(tmp_path / "b", stop=10)  # its final checkpoint: step 10
    resumed, _ = run(tmp_path / "b")
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def saving_without_an_optimizer(run_dir, save_at=None, stop=None):
    """A script updating its parameters itself that saves in its loop body (at its
    top or its bottom) after ``stop`` batches and stops there; 10 batches."""
    torch.manual_seed(0)
    x = torch.randn(40, 4)
    loader = DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=4)
    model = nn.Linear(4, 2)
    session = Session([Checkpoint(every=100, final=False)], run_dir=run_dir)
    model, _, loader = session.prepare(model, None, loader)
    session.start()
    trained = 0
    for xb, yb in loader:
        if save_at == "top" and trained == stop:
            session.save()
            break
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
        trained += 1
        if save_at == "bottom" and trained == stop:
            session.save()
            break
    session.finish()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), session.state.step


def test_a_save_in_a_loop_without_an_optimizer_is_numbered_or_told(tmp_path):
    """Without an optimizer, a save after the script's own update was numbered one
    step early (the resume ended a step short of the run never stopped: steps(n)
    trained a batch more), and a save before its forward, its batch taken, had the
    resume skip that batch, silently (an optimizer's loop is told)."""
    straight, steps = saving_without_an_optimizer(tmp_path / "a")
    saving_without_an_optimizer(tmp_path / "b", "bottom", stop=4)
    resumed, resumed_steps = saving_without_an_optimizer(tmp_path / "b")
    assert torch.equal(resumed, straight) and resumed_steps == steps == 10  # was 9
    with pytest.warns(LoopWarning, match="before its forward: its batch") as said:
        saving_without_an_optimizer(tmp_path / "c", "top", stop=4)
    assert said[0].filename == __file__


@pytest.mark.parametrize("register", [True, False])
def test_a_learning_rate_annealed_by_hand_without_an_optimizer_is_told(tmp_path, register):
    """word_language_model updates its parameters itself with an ``lr`` it divides by 4
    when the validation loss does not improve: left unregistered, a resume went on
    with the first lr (16 times too large after two anneals), with no word. Without
    an optimizer, the session now says what to register, naming what is."""

    def script(run_dir, stop_at=None):
        torch.manual_seed(0)
        x = torch.randn(40, 4)
        loader = DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=4)
        model = nn.Linear(4, 2)
        session = Session([Checkpoint(every=3)], run_dir=run_dir)
        model, _, loader = session.prepare(model, None, loader)
        lr = 1.0
        start = session.start(**({"lr": lambda: lr} if register else {}))
        lr = start.values.get("lr", lr)
        for _epoch in range(start.epoch, 3):
            for xb, yb in loader:
                model.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-lr)
                if session.state.step + 1 == stop_at:
                    return session.finish(), None
            lr /= 4.0  # annealed by hand at each epoch's end
        summary = session.finish()
        return summary, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    summary, straight = script(tmp_path / "a")
    script(tmp_path / "b", stop_at=24)  # epoch 2, after two anneals
    _, resumed = script(tmp_path / "b")
    said = [n for n in summary.get("notes", []) if "no optimizer" in n]
    assert len(said) == 1 and "session.start(lr=lambda: lr)" in said[0]
    if register:
        assert torch.equal(resumed, straight) and "(lr here)" in said[0]
        return
    assert not torch.equal(resumed, straight)  # what it is told about
    assert "(nothing here)" in said[0]


class TinyRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x, hidden):
        out, hidden = self.rnn(x, hidden)
        return self.head(out), hidden


def carrying_script(run_dir, register, stop_at=None):
    """pytorch/examples' word_language_model's shape: the RNN's hidden state carried
    from batch to batch (detached), parameters updated by hand, 10 batches an epoch."""
    torch.manual_seed(0)
    data = torch.randn(41, 2, 3)  # (time, batch, features)
    targets = (data.sum(-1) > 0).long()
    model = TinyRNN()
    session = Session([Checkpoint(every=3)], run_dir=run_dir)
    model, _, offsets = session.prepare(model, None, DataLoader(range(0, 40, 4), batch_size=None))
    carry = {}
    start = session.start(**({"carry": carry} if register else {}))
    for epoch in range(start.epoch, 2):
        resumed = register and epoch == start.epoch and start.batch > 0
        hidden = carry["hidden"] if resumed else torch.zeros(1, 2, 5)
        for i in offsets:
            output, hidden = model(data[i : i + 4], hidden.detach())
            model.zero_grad()
            loss = nn.functional.cross_entropy(
                output.reshape(-1, 2), targets[i : i + 4].reshape(-1)
            )
            loss.backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)
            carry["hidden"] = hidden
            if session.state.step + 1 == stop_at:
                break  # its final checkpoint: the resume goes on with the next batch
        else:
            continue
        break
    summary = session.finish()
    return summary, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("register", [True, False])
def test_state_carried_from_batch_to_batch_is_registered_or_told(tmp_path, register):
    """An RNN's hidden state carried across batches is no state the session sees: a
    resume mid-epoch started it afresh, silently (the parameters parted from the run
    never stopped). Now a LoopWarning at the forward that takes it, and a note,
    unless something registered holds it; registered, the resume is exact."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", LoopWarning)
        summary, straight = carrying_script(tmp_path / "a", register)
        carrying_script(tmp_path / "b", register, stop_at=14)  # epoch 1, batch 4
        resumed_summary, resumed = carrying_script(tmp_path / "b", register)
    assert resumed_summary["optimizations"]["checkpoint"]["resumed_from_step"] == 14
    told = [w for w in said if "carried from batch to batch" in str(w.message)]
    notes = [n for n in summary.get("notes", []) if "carried from batch to batch" in n]
    if register:
        assert torch.equal(resumed, straight) and not told and not notes
        return
    assert not torch.equal(resumed, straight)  # what it is told about
    assert len(told) == 3 and len(notes) == 1  # once in each of the 3 runs
    assert "session.start(carry=carry)" in str(told[0].message)
    assert told[0].filename == __file__
    assert "model(data[i" in Path(__file__).read_text().splitlines()[told[0].lineno - 1]


def test_a_model_returning_its_input_is_not_told_it_carries_state(tmp_path):
    """A model returning a view of what it took (a VAE's ``[recon, input, mu,
    logvar]``) over batches that are views of one tensor (data on the device, sliced)
    was told it carried state from batch to batch: the next batch shares the storage
    the forward before returned."""

    class Returning(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(6, 3)

        def forward(self, x):
            return self.layer(x), x.flatten()

    data = torch.randn(32, 6)
    for batches in ([data[i : i + 4] for i in range(0, 32, 4)], [data[:4]] * 8):
        model = Returning()
        session = Session([Checkpoint(every=3)], run_dir=tmp_path)
        model, _, loader = session.prepare(model, None, batches)
        with warnings.catch_warnings():
            warnings.simplefilter("error", LoopWarning)
            for x in loader:
                out, _ = model(x)
                out.square().mean().backward()
                manual_sgd(model)
        summary = session.finish()
        assert not [n for n in summary.get("notes", []) if "carried" in n]
        shutil.rmtree(tmp_path / "checkpoints")


def test_a_state_updated_in_place_and_returned_is_told(tmp_path):
    """The look left out every output over a storage the forward took, so a state the
    model updates in place and returns (``out, h = model(x, h)``) was no longer told."""

    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(6, 3)

        def forward(self, x, h):
            with torch.no_grad():
                h.mul_(0.9).add_(x.mean(0))
            return self.layer(x + h), h

    model = Stateful()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = Session([Checkpoint(every=3)], run_dir=tmp_path)
    model, optimizer, loader = session.prepare(model, optimizer, [torch.randn(4, 6)] * 6)
    h = torch.zeros(6)
    with pytest.warns(LoopWarning, match="carried from batch to batch"):
        for x in loader:
            optimizer.zero_grad()
            out, h = model(x, h)
            out.square().mean().backward()
            optimizer.step()
    assert any("carried" in note for note in session.finish()["notes"])


def test_a_script_accumulating_batches_itself_resumes_exactly(tmp_path):
    """Each batch is a step: in a script that steps its optimizer every second batch, a
    checkpoint due between the two would lose the first's gradient. It waits for the
    next step that follows an optimizer step, and the summary says so."""

    def run(folder, stop=None):
        torch.manual_seed(0)
        x = torch.randn(64, 4)
        loader = DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=4, shuffle=True)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        session = Session([Checkpoint(every=3)], run_dir=folder, progress=False)
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        session.start()
        for batch, (xb, yb) in enumerate(loader, start=session.state.step):
            (nn.functional.cross_entropy(model(xb), yb) / 2).backward()
            if batch % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
            if batch + 1 == stop:
                break
        summary = session.finish()
        return [p.detach().clone() for p in model.parameters()], summary

    straight, summary = run(tmp_path / "a")
    section = summary["optimizations"]["checkpoint"]
    assert any("came due inside an update" in note for note in section["notes"])
    assert "16 steps and 8 optimizer steps" in " ".join(summary["notes"])
    steps = [e["step"] for e in Manifest(tmp_path / "a" / "checkpoints").read()]
    assert steps and all(step % 2 == 0 for step in steps)  # after an optimizer step
    run(tmp_path / "b", stop=10)  # its last checkpoint: step 10 (9 came due mid-update)
    resumed, _ = run(tmp_path / "b")
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def fetching_ahead(tmp_path, checkpoint, steps):
    """nanoGPT's shape: forward, fetch the next batch, backward, step, ``steps`` times
    (each telling a LoopWarning). Returns the session, the loader's iterator and the
    warnings."""
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    loader = DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=4)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = Session([checkpoint], run_dir=tmp_path, progress=False)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    batches = iter(loader)
    inputs, targets = next(batches)
    with pytest.warns(LoopWarning, match="fetches its next batch before it updates") as said:
        for _ in range(steps):
            loss = nn.functional.cross_entropy(model(inputs), targets)
            inputs, targets = next(batches)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return session, batches, said


def test_a_loop_fetching_its_next_batch_before_it_updates_is_told(tmp_path):
    """Every step boundary of nanoGPT's shape falls inside an update: no checkpoint
    could resume exactly, so none is taken before the end, and a LoopWarning says why,
    pointing at the script's line."""
    session, batches, said = fetching_ahead(tmp_path, Checkpoint(every=3, final=False), 12)
    assert said[0].filename == __file__
    batches.close()
    summary = session.finish()
    assert summary["optimizations"]["checkpoint"]["checkpoints"] == 0
    assert not Manifest(tmp_path / "checkpoints").read()


def test_a_loop_fetching_ahead_gets_no_final_checkpoint_that_would_lose_a_batch(tmp_path):
    """nanoGPT's shape ends holding the batch it fetched for the next iteration: a final
    checkpoint after it (taken before) resumed with that batch lost, unlike the run never
    stopped. None is taken, and the checkpoint's notes say why."""
    session, _batches, _ = fetching_ahead(tmp_path, Checkpoint(every=100), 5)
    summary = session.finish()
    assert not Manifest(tmp_path / "checkpoints").read()  # was: one at step 6, 5 trained
    (said,) = summary["optimizations"]["checkpoint"]["notes"]
    assert "no final checkpoint" in said and "never trained" in said


def accumulating_script(run_dir, stop_at=None, save_on="update", resumed_skip=None):
    """run_clm_no_trainer's loop: 3 batches an update (the first update after one:
    ``step % 3 == 0``), a save every 2 updates by session.save(), a stop (a kill: no
    finish) after update ``stop_at``. ``save_on="batch"`` saves on every batch while the
    count of updates stays at a multiple of 2, as the script does. After a resume the
    script counts batches from start.batch, or skips them by hand
    (``resumed_skip="hand"``). Returns the losses, the parameters and the session."""
    model, optimizer, loader = parts(samples=96)  # 12 batches an epoch
    session = Session([Checkpoint(every=1000, final=False)], run_dir=run_dir)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    updates = 0
    start = session.start(updates=lambda: updates)
    updates = start.values["updates"]
    losses = []
    for epoch in range(start.epoch, 2):
        first = start.batch if epoch == start.epoch and resumed_skip != "hand" else 0
        for step, (x, y) in enumerate(loader, first):
            if resumed_skip == "hand" and epoch == start.epoch and step < start.batch:
                continue
            loss = nn.functional.cross_entropy(model(x), y)
            (loss / 3).backward()
            losses.append(loss.item())
            sync = step % 3 == 0 or step == len(loader) - 1
            if sync:
                optimizer.step()
                optimizer.zero_grad()
                updates += 1
            if updates % 2 == 0 and (sync or save_on == "batch"):
                session.save()
            if updates == stop_at:
                return losses, None, session
    session.finish()
    return losses, [p.detach().clone() for p in model.parameters()], session


def test_a_save_after_the_update_in_the_loop_body_resumes_at_the_next_batch(tmp_path):
    """session.save() in the loop body after optimizer.step() is the step's end: it was
    labelled with the step's own number, so a resume started one step early (its
    step count one short: one step more under steps(n), a checkpoint's number one
    below the batches trained). Resumed, the run equals the one never stopped."""
    straight, params, _ = accumulating_script(tmp_path / "a")
    first, _, _ = accumulating_script(tmp_path / "b", stop_at=9)
    steps = [entry["step"] for entry in Manifest(tmp_path / "b" / "checkpoints").read()]
    assert steps == [13, 19]  # updates 8 at batch 18 (epoch 1, batch 6): 19 batches trained
    rest, resumed, session = accumulating_script(tmp_path / "b")
    assert (session._start.step, session._start.epoch, session._start.batch) == (19, 1, 7)
    assert first[:19] + rest == straight
    assert all(torch.equal(a, b) for a, b in zip(params, resumed, strict=True))

    def steps_of_six(resume=False, stop=None):
        model, optimizer, loader = parts()
        session = Session(run_dir=tmp_path / "c")
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        if resume:
            session.load(tmp_path / "c" / "checkpoints")
        trained = 0
        for x, y in session.steps(6):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            trained += 1
            if session.state.step == stop:
                session.save()
                return trained
        session.finish()
        return trained

    assert steps_of_six(stop=2) + steps_of_six(resume=True) == 6  # was 3 + 4


def test_a_save_inside_an_update_or_before_a_forward_is_told(tmp_path):
    """A save between a forward and its optimizer step leaves out the gradients
    accumulated so far; one before the step's forward has its batch taken from the
    loader: neither resumes exactly, and both were silent."""
    with pytest.warns(LoopWarning, match="between a forward and its optimizer step") as said:
        *_, session = accumulating_script(tmp_path / "a", save_on="batch")
    assert said[0].filename == __file__
    assert any("cannot resume exactly: session.save()" in n for n in session.notes)
    model, optimizer, loader = parts()
    session = Session(run_dir=tmp_path / "b")
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    with pytest.warns(LoopWarning, match="before its forward: its batch"):
        for x, y in loader:
            session.save()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    session.finish()


def test_skipping_the_resumed_batches_by_hand_too_is_told(tmp_path):
    """run_clm_no_trainer skips the first batches of the resumed epoch by hand (``if
    step < resume_step: continue``); the loader already goes on after them, so they
    were skipped twice, silently. A LoopWarning at the script's loop says so."""
    accumulating_script(tmp_path / "a", stop_at=9)
    with pytest.warns(LoopWarning, match="skips them twice") as said:
        *_, session = accumulating_script(tmp_path / "a", resumed_skip="hand")
    assert said[0].filename == __file__
    assert any("enumerate(loader, start.batch)" in n for n in session.notes)
    accumulating_script(tmp_path / "b", stop_at=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoopWarning)
        accumulating_script(tmp_path / "b")  # counted from start.batch: nothing to tell


def test_an_object_registered_after_load_is_restored(tmp_path, capfd):
    """session.load() and then session.start(scheduler=...) left the scheduler as new
    (the saved one was never applied), silently, and said the resume twice."""
    model, optimizer, loader = parts()
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    session = Session(run_dir=tmp_path)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    session.start(schedule=schedule)
    one_epoch(model, loader, optimizer)
    schedule.step()
    schedule.step()
    session.save()
    session.finish()
    model, optimizer, loader = parts()
    again = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    session = Session()
    session.prepare(model, optimizer, loader)
    capfd.readouterr()
    session.load(tmp_path / "checkpoints")
    session.start(schedule=again)
    assert again.last_epoch == 2 and optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    assert capfd.readouterr().err.count("resumed at step 5") == 1
    with pytest.raises(CheckpointError, match=r"no checkpoint at step 3 .* lists step\(s\) 5"):
        Session().load(tmp_path / "checkpoints" / "step-00000003")


def test_a_script_keeping_its_last_loss_has_its_files_flushed_at_exit(tmp_path):
    """The hook on a forward's output held the session; the autograd graph holding the
    hook is out of the garbage collector's sight, so a script keeping its last
    ``loss`` (any module-level loop) kept the session alive, and through a
    ``lambda: value`` registered with it the module's globals: past the exit, and a
    log file the script never closed lost what it had written (empty here)."""
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch
            from torch import nn
            from torch.utils.data import DataLoader, TensorDataset
            import overlapkit

            model = nn.Linear(3, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            data = TensorDataset(torch.randn(8, 3), torch.randint(2, (8,)))
            session = overlapkit.Session()
            model, optimizer, loader = session.prepare(model, optimizer, DataLoader(data, 4))
            steps = 0
            session.start(steps=lambda: steps)
            log = open({str(tmp_path / "log.txt")!r}, "w")
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                steps += 1
                log.write(f"step {{steps}}\\n")
            session.finish()
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "log.txt").read_text() == "step 1\nstep 2\n"


class NativeScaler:
    """timm's wrapper: the script registers it, not the GradScaler it holds."""

    def __init__(self, scaler):
        self._scaler = scaler

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state):
        self._scaler.load_state_dict(state)


@pytest.mark.parametrize("registered", [False, True, "wrapped"])
def test_a_scripts_own_grad_scaler_is_checkpointed_or_said_not_to_be(tmp_path, registered):
    """A script with its own GradScaler: registered, its scale is saved and restored;
    not registered, a LoopWarning at the script's ``scaler.step`` and a note say the
    resume cannot be exact (the scale would restart from its initial value)."""
    model, optimizer, loader = parts()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    session = Session([Checkpoint(every=2)], run_dir=tmp_path, progress=False)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    wrapped = NativeScaler(scaler) if registered == "wrapped" else scaler
    session.start(**({"scaler": wrapped} if registered else {}))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", LoopWarning)
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # the line the warning points at
            scaler.update()
            optimizer.zero_grad()
    summary = session.finish()
    told = [w for w in said if "GradScaler is not checkpointed" in str(w.message)]
    notes = [n for n in summary.get("notes", []) if "GradScaler" in n]
    if registered:
        assert not told and not notes
        resumed = Session([Checkpoint(every=2)], run_dir=tmp_path, progress=False)
        again = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
        resumed.prepare(*parts()[:2])
        assert resumed.start(scaler=again).resumed_from is not None
        assert again.get_scale() == scaler.get_scale() != 2.0**8
    else:
        assert len(told) == 1 and told[0].filename == __file__
        line = Path(__file__).read_text().splitlines()[told[0].lineno - 1]
        assert "scaler.step(optimizer)" in line
        assert notes and "session.start(scaler=scaler)" in notes[0]


def torchvision_epochs(run_dir, registered, stop=None):
    """torchvision's classification loop, ported: a StepLR stepped per epoch, an EMA
    of parameters and buffers (``AveragedModel``) updated every other batch, no
    GradScaler (no --amp: None); 3 epochs of 5 batches, checkpoints every 2 steps;
    ``stop``: leave after that many steps (a final checkpoint)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model, optimizer, loader = parts()
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model_ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    scaler = None
    session = Session([Checkpoint(every=2)], run_dir=run_dir, progress=False)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    saved = {"lr_scheduler": lr_scheduler, "model_ema": model_ema} if registered else {}
    start = session.start(scaler=scaler, **saved)  # the line told
    for epoch in range(start.epoch, 3):
        for i, (x, y) in enumerate(loader, start.batch if epoch == start.epoch else 0):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if i % 2 == 0:
                model_ema.update_parameters(model)
            if session.state.step + 1 == stop:
                break
        if session.state.step == stop:
            break
        lr_scheduler.step()
    return session.finish(), model_ema, lr_scheduler


@pytest.mark.parametrize("registered", [True, False])
def test_an_lr_schedule_or_an_ema_left_unregistered_is_told(tmp_path, registered):
    """A port of torchvision's classification script: its per-epoch LR schedule and
    its EMA registered, the resume is exact. Left out, a resume restarted the
    schedule's count (with the saved learning rate) and the average, silently: now a
    LoopWarning at the line that starts the run, and a note, for each. Its scaler,
    None without --amp, is nothing to save (it was a TypeError advising
    ``scaler=lambda: scaler``, which saves an EMA without restoring it)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", LoopWarning)
        _, ema, schedule = torchvision_epochs(tmp_path / "straight", registered)
        torchvision_epochs(tmp_path / "resumed", registered, stop=7)
        summary, ema_again, schedule_again = torchvision_epochs(tmp_path / "resumed", registered)
    assert summary["optimizations"]["checkpoint"]["resumed_from_step"] == 7
    same_ema = all(
        torch.equal(a, b)
        for a, b in zip(ema.state_dict().values(), ema_again.state_dict().values(), strict=True)
    )
    same_schedule = schedule_again.state_dict() == schedule.state_dict()
    told = [str(w.message) for w in said if "not checkpointed" in str(w.message)]
    notes = [n for n in summary.get("notes", []) if "not checkpointed" in n]
    if registered:
        assert same_ema and same_schedule and not told and not notes
        return
    assert not same_ema and not same_schedule  # what they are told about
    assert len(told) == 6 and len(notes) == 2  # 2 in each of the 3 runs
    assert "LR schedule" in told[0] and "session.start(lr_scheduler=lr_scheduler)" in told[0]
    assert "session.start(model_ema=model_ema)" in told[1]
    where = [w for w in said if "not checkpointed" in str(w.message)][0]
    assert where.filename == __file__
    assert "session.start(" in Path(__file__).read_text().splitlines()[where.lineno - 1]


def test_a_registered_schedule_of_another_library_is_not_told_unregistered(tmp_path):
    """timm's schedulers are no torch LRScheduler but set torch's ``initial_lr`` in the
    optimizer's groups too: registered, the run was still told 'the optimizer's LR
    schedule is not checkpointed' (and noted it cannot resume exactly)."""

    class TimmLikeScheduler:  # timm.scheduler.Scheduler's shape
        def __init__(self, optimizer):
            self.optimizer = optimizer
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
            self.epoch = 0

        def state_dict(self):
            return {"epoch": self.epoch}

        def load_state_dict(self, state):
            self.epoch = state["epoch"]

    model, optimizer, loader = parts()
    schedule = TimmLikeScheduler(optimizer)
    session = Session([Checkpoint(every=2)], run_dir=tmp_path, progress=False)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", LoopWarning)
        session.start(lr_scheduler=schedule)
    summary = session.finish()
    assert not [str(w.message) for w in said if "not checkpointed" in str(w.message)]
    assert not [n for n in summary.get("notes", []) if "not checkpointed" in n]


def test_checkpoints_waiting_out_steps_a_grad_scaler_skipped_say_so(tmp_path):
    """A loss scale too large: the scaler skips the optimizer steps (inf gradients),
    so checkpoints due then wait for an update; the summary names the scaler among
    the causes (it named only loop shapes this script does not have)."""
    model, optimizer, loader = parts()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-12)
    session = Session([Checkpoint(every=1)], run_dir=tmp_path, progress=False)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    session.start(scaler=scaler)
    for x, y in loader:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    notes = session.finish()["optimizations"]["checkpoint"]["notes"]
    assert scaler.get_scale() < 2.0**40  # it skipped
    assert any("GradScaler skipped" in note for note in notes), notes


def test_a_schedule_both_the_session_and_the_script_step_is_stepped_once():
    """A port that passed its per-iteration schedule to prepare() and kept its own
    scheduler.step(): the updates use the script's learning rates (0.1, 0.05, ...;
    stepped twice they halved twice per update), and a LoopWarning says why."""
    model, optimizer, loader = parts()  # 5 batches
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    session = Session([], progress=False)
    model, optimizer, loader = session.prepare(model, optimizer, loader, lr_scheduler=schedule)
    used = []  # the rate each update uses (a hook after the session's own)
    optimizer.register_step_pre_hook(lambda opt, *_: used.append(opt.param_groups[0]["lr"]))
    with pytest.warns(
        LoopWarning, match="steps the LR schedule it gave to session.prepare"
    ) as told:
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            schedule.step()
    session.finish()
    assert used == pytest.approx([0.1 * 0.5**k for k in range(5)])
    assert "differs" not in str(told[0].message)  # no update used another rate
    assert schedule.last_epoch == 5


def test_a_per_epoch_schedule_stepped_by_both_keeps_the_scripts_steps_only():
    """All the session's steps are undone, not only its last (the epoch's 5 per-update
    steps left the rate at 0.5**5 after the undo); a schedule that is not torch's (only
    step()) is stepped by the session as before, not refused."""
    model, optimizer, loader = parts()  # 5 batches an epoch
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    session = Session([], progress=False)
    model, optimizer, loader = session.prepare(model, optimizer, loader, lr_scheduler=schedule)
    used = []
    optimizer.register_step_pre_hook(lambda opt, *_: used.append(opt.param_groups[0]["lr"]))
    # ...and says the updates so far used the session's rates, not the script's.
    with pytest.warns(LoopWarning, match="the session's 5 step.*but 4 update.*differs"):
        for _epoch in range(2):
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
            schedule.step()  # the script's, once an epoch
    session.finish()
    assert used[5:] == pytest.approx([0.05] * 5) and schedule.last_epoch == 2

    class Warmup:  # a script's own: step() and nothing else
        steps = 0

        def step(self):
            self.steps += 1

    model, optimizer, loader = parts()
    session = Session([], progress=False)
    warmup = Warmup()
    model, optimizer, loader = session.prepare(model, optimizer, loader, lr_scheduler=warmup)
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    session.finish()
    assert warmup.steps == 5


def gan(run_dir, register_g=True, stop_after=None):
    """DCGAN's loop: a discriminator step (real, then a detached fake), then a
    generator step through the discriminator. The discriminator is prepared; the
    generator and its optimizer are registered (or, ``register_g=False``, only the
    generator). Two epochs of 6 steps; a checkpoint every 3 steps, none at the end."""
    torch.manual_seed(0)
    real = DataLoader(TensorDataset(torch.randn(24, 4) + 2), batch_size=4, shuffle=True)
    net_d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    net_g = nn.Linear(3, 4)
    opt_d = torch.optim.Adam(net_d.parameters(), lr=0.01)
    opt_g = torch.optim.Adam(net_g.parameters(), lr=0.01)
    bce = nn.BCEWithLogitsLoss()
    session = Session([Checkpoint(every=3, final=False)], run_dir=run_dir, progress=False)
    net_d, opt_d, real = session.prepare(net_d, opt_d, real)
    start = session.start(net_g=net_g, **({"opt_g": opt_g} if register_g else {}))
    steps = 0
    for _epoch in range(start.epoch, 2):
        for (batch,) in real:
            net_d.zero_grad()
            bce(net_d(batch), torch.ones(4, 1)).backward()
            fake = net_g(torch.randn(4, 3))
            bce(net_d(fake.detach()), torch.zeros(4, 1)).backward()
            opt_d.step()
            net_g.zero_grad()
            bce(net_d(fake), torch.ones(4, 1)).backward()
            opt_g.step()
            steps += 1
            if steps == stop_after:
                break
        if steps == stop_after:
            break
    summary = session.finish()
    params = torch.cat([p.detach().reshape(-1) for p in [*net_d.parameters(), *net_g.parameters()]])
    return start, summary, params


def test_a_gan_with_its_second_optimizer_registered_resumes_exactly(tmp_path):
    """The generator's step runs the prepared discriminator after its optimizer step:
    the registered generator optimizer's step ends that update, so checkpoints are
    taken (none were: every boundary looked like one inside an update) and a resume
    equals the uninterrupted run."""
    _, _, straight = gan(tmp_path / "straight")
    _, summary, _ = gan(tmp_path / "run", stop_after=8)
    assert summary["optimizations"]["checkpoint"]["checkpoints"] == 2  # steps 3 and 6
    start, _, resumed = gan(tmp_path / "run")
    assert start.step == 6 and start.resumed_from is not None
    assert torch.equal(resumed, straight)


def test_a_registered_optimizer_stepping_first_never_changes_a_snapshot(tmp_path, monkeypatch):
    """Two optimizers over one model (AdamW + Muon): the registered one steps first.
    The snapshot copies in the background what only the prepared optimizer's step
    changes; here each background copy runs as late as allowed (just before that
    step), so a copy of what the registered one stepped would hold its update and
    the resume would apply it twice."""
    from overlapkit.optimizations.checkpoint import snapshot as snapshots

    parked = {}
    start_thread = snapshots.start_thread

    def park(target, *args, name=""):
        if name != "overlapkit-snapshot":
            return start_thread(target, *args, name=name)
        parked[id(args[0])] = (target, args)

    def wait(self):
        if (call := parked.pop(id(self), None)) is not None:
            call[0](*call[1])
        waited(self)

    waited = snapshots.Snapshot.wait
    monkeypatch.setattr(snapshots, "start_thread", park)
    monkeypatch.setattr(snapshots.Snapshot, "wait", wait)

    def script(run_dir, stop_at=None):
        model, _, loader = parts(samples=64)
        first = torch.optim.SGD(model[0].parameters(), lr=0.5)  # registered, steps first
        last = torch.optim.SGD(model[3].parameters(), lr=0.1, momentum=0.9)
        session = Session([Checkpoint(every=2, final=stop_at is None)], run_dir=run_dir)
        model, last, loader = session.prepare(model, last, loader)
        session.start(first=first)
        for x, y in loader:
            if session.state.step == stop_at:
                break
            first.zero_grad()
            last.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            first.step()
            last.step()
        session.finish()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    straight = script(tmp_path / "a")
    script(tmp_path / "b", stop_at=5)  # its last checkpoint: step 4
    assert torch.equal(script(tmp_path / "b"), straight)


def test_a_loop_accumulating_three_batches_is_not_told_its_checkpoints_starve(tmp_path):
    """Its boundaries clear at each update: checkpoints are taken there, and no
    warning says otherwise (one did with every: 1 and 3 batches an update)."""
    model, optimizer, loader = parts()  # 5 batches an epoch
    session = Session([Checkpoint(every=1, final=False)], run_dir=tmp_path, progress=False)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", LoopWarning)
        for _epoch in range(3):
            for i, (x, y) in enumerate(loader):
                nn.functional.cross_entropy(model(x), y).backward()
                if i % 3 == 2:
                    optimizer.step()
                    optimizer.zero_grad()
    summary = session.finish()
    assert not [str(w.message) for w in said if issubclass(w.category, LoopWarning)]
    assert summary["optimizations"]["checkpoint"]["checkpoints"] > 0


def test_a_gan_whose_second_optimizer_is_not_registered_is_told(tmp_path):
    with pytest.warns(
        LoopWarning, match="checkpoint due by step 3 not taken.*session.start"
    ) as said:
        _, summary, _ = gan(tmp_path, register_g=False)
    assert said[0].filename == __file__
    assert summary["optimizations"]["checkpoint"]["checkpoints"] == 0


def _gan_phases(session: Session, samples: int, fail_first: bool = False) -> tuple[list, nn.Module]:
    """DCGAN's loop with the discriminator prepared and the generator registered: the
    phase the clock is in at each of the generator's forwards and its optimizer's steps,
    and the generator. ``fail_first``: its first forward raises, and the script skips
    the rest of that step."""
    phases: list[str] = []

    class Generator(nn.Linear):
        def forward(self, x):
            phases.append(session.state.clock.current)
            if fail_first and len(phases) == 1:
                raise RuntimeError("a generator's error")
            return super().forward(x)

    class Adam(torch.optim.Adam):
        def step(self, closure=None):
            phases.append(session.state.clock.current)
            return super().step(closure)

    torch.manual_seed(0)
    real = DataLoader(TensorDataset(torch.randn(samples, 4) + 2), batch_size=4)
    net_d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    net_g = Generator(3, 4)
    opt_d = torch.optim.Adam(net_d.parameters(), lr=0.01)
    opt_g = Adam(net_g.parameters(), lr=0.01)
    bce = nn.BCEWithLogitsLoss()
    net_d, opt_d, real = session.prepare(net_d, opt_d, real)
    session.start(net_g=net_g, opt_g=opt_g)
    for (batch,) in real:
        net_d.zero_grad()
        bce(net_d(batch), torch.ones(4, 1)).backward()
        try:
            fake = net_g(torch.randn(4, 3))
        except RuntimeError:
            continue  # the rest of this step skipped
        bce(net_d(fake.detach()), torch.zeros(4, 1)).backward()
        opt_d.step()
        net_g.zero_grad()
        bce(net_d(fake), torch.ones(4, 1)).backward()
        opt_g.step()
    return phases, net_g


def test_a_registered_models_forward_and_optimizer_step_are_timed_as_such(tmp_path):
    """DCGAN's generator (registered, the discriminator prepared): its forward and its
    optimizer's step were timed as ``other``, the script's own time (with ngf=32,
    0.31 s of a step's 0.32 s of other; forward and optimizer looked 25% and 2%)."""
    session = Session(run_dir=tmp_path)
    phases, net_g = _gan_phases(session, 12)
    with torch.no_grad():
        net_g(torch.randn(4, 3))  # outside any step: the script's own
    session.finish()
    assert phases == [*["forward", "optimizer"] * 3, "other"], phases


def test_a_registered_models_forward_that_raised_leaves_later_ones_timed():
    """The script catches a generator's error and skips the rest of the step: the call
    never said it was done, and no later call of it or its optimizer was timed."""
    session = Session()
    phases, _ = _gan_phases(session, 16, fail_first=True)
    session.finish()
    assert phases == ["forward", *["forward", "optimizer"] * 3], phases


def test_the_prepared_model_can_be_saved_whole_and_copied():
    """torch.save(model) (as word_language_model saves its best model) failed while the
    session ran: the session's hooks pickled the session. Copies get inert hooks."""
    import copy
    import io

    model, optimizer, loader = parts()
    session = Session(progress=False)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    ema = copy.deepcopy(model)
    x = torch.randn(2, 6)
    assert torch.equal(loaded.eval()(x), model.eval()(x)) and ema(x).shape == (2, 3)
    assert all(hook is not None for hook in loaded._forward_pre_hooks.values())
    session.finish()


def two_checkpointed_epochs(run_dir, stop=None, batch=8, warmup_steps=0):
    """The epoch loop of a ported script, 2 epochs (5 batches of 8 each), checkpoints
    every 2 steps in ``run_dir``; ``stop``: leave it after that many steps."""
    model, optimizer, loader = parts(batch=batch)
    session = Session(
        [Checkpoint(every=2)], run_dir=run_dir, progress=False, warmup_steps=warmup_steps
    )
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    start = session.start()
    for _epoch in range(start.epoch, 2):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if session.state.step + 1 == stop:
                break
        if session.state.step == stop:
            break
    return session.finish()


def test_a_resumed_run_keeps_the_earlier_steps_in_steps_jsonl(tmp_path):
    """steps.jsonl held only the last process's steps after a resume."""
    two_checkpointed_epochs(tmp_path, stop=3)
    summary = two_checkpointed_epochs(tmp_path)
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(10))  # 2 epochs of 5 batches, each step once
    assert summary["optimizations"]["checkpoint"]["resumed_from_step"] == 3


def test_a_resumed_process_warms_up_on_its_first_step(tmp_path):
    """With a warm-up asked for, a resumed process's first step (its compilation, cold
    caches: on TensorFlow a second) is left out of the measurements too."""
    two_checkpointed_epochs(tmp_path, stop=3, warmup_steps=1)
    two_checkpointed_epochs(tmp_path, warmup_steps=1)
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    warmup = [json.loads(line)["step"] for line in lines if json.loads(line)["warmup"]]
    assert warmup == [0, 3]  # the run's first, and the resumed process's first


def test_a_run_resumed_at_its_last_step_measures_nothing_and_says_so(tmp_path):
    """Its one step is warm-up: no figure is made up (it showed 0.0 samples/s)."""
    from rich.console import Console

    from overlapkit.compare_runs import RunFolderError, load_run
    from overlapkit.runtime.report import summary_tables

    two_checkpointed_epochs(tmp_path, stop=9, warmup_steps=1)
    summary = two_checkpointed_epochs(tmp_path, warmup_steps=1)
    assert summary["steps"] == 0 and summary["samples_per_s"] is None
    assert summary["step_time_s"]["mean"] is None and summary["pop"]["load_balance"] is None
    console = Console(record=True, width=120)
    for table in summary_tables(summary):
        console.print(table)
    assert "not measured: no step after the warm-up" in console.export_text()
    with pytest.raises(RunFolderError, match="measured no step"):
        load_run(tmp_path)


def test_running_a_finished_run_again_keeps_its_results(tmp_path, capfd):
    """The same script run again over a finished run resumes at its last step and
    trains nothing: its summary of no steps replaced the run's results."""
    first = two_checkpointed_epochs(tmp_path)
    files = {name: (tmp_path / name).read_text() for name in ("summary.json", "steps.jsonl")}
    two_checkpointed_epochs(tmp_path)
    assert {name: (tmp_path / name).read_text() for name in files} == files
    assert first["steps"] == 10 and "trained no step" in capfd.readouterr().err


def test_resuming_with_another_batch_size_is_refused_not_silent(tmp_path):
    """The loader's position in a checkpoint is in batches: resumed with another batch
    size it named other samples, and the run went on without a word."""
    two_checkpointed_epochs(tmp_path, stop=3)
    with pytest.raises(ValueError, match="saved by a DataLoader of batch size 8; this one has 4"):
        two_checkpointed_epochs(tmp_path, batch=4)

"""Two-phase checkpointing: exact resume, isolation from later updates, integrity, disk errors."""

import contextlib
import gc
import json
import os
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import torch
from rank_programs import mlp

from conftest import TINY_SCENARIO, run_cli
from overlapkit import Session, get_optimization
from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages
from overlapkit.launch.local import launch_local
from overlapkit.optimizations.checkpoint import (
    AutoInterval,
    CheckpointCorruptWarning,
    CheckpointError,
)
from overlapkit.optimizations.checkpoint.fileformat import read as read_checkpoint
from overlapkit.optimizations.checkpoint.persister import Persister
from overlapkit.optimizations.checkpoint.snapshot import Snapshotter
from overlapkit.runtime.optimization import CombinationError
from overlapkit.runtime.rng import seed_everything

Checkpoint = get_optimization("checkpoint")


def train(run_dir, steps, *, every=3, momentum=0.9, on_step=None, **knobs):
    """One rank, the test MLP with dropout (so RNG state matters), SGD with momentum."""
    seed_everything(0)
    model = torch.nn.Sequential(mlp(), torch.nn.Dropout(0.1))
    data = SyntheticImages((3, 8, 8), num_classes=4, num_samples=96, seed=0)
    loader = ResumableLoader(data, 16, ShardedSampler(len(data), seed=0))
    checkpoint = Checkpoint(every=every, **knobs)
    session = Session([checkpoint], device="cpu", run_dir=run_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    model, optimizer, _ = session.prepare(model, optimizer, loader)
    losses = {}
    for inputs, targets in session.steps(steps):
        with session.forward():
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        session.backward(loss)
        session.optimizer_step()
        losses[session.state.step] = float(loss.detach())
        if on_step is not None:
            on_step(session, model)
    summary = session.finish()
    return losses, model, summary["optimizations"]["checkpoint"]


def params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_interrupted_and_resumed_run_is_bitwise_identical(tmp_path):
    straight_losses, straight_model, _ = train(tmp_path / "a", 14)
    # 96 samples / 16 = 6 batches an epoch: step 7 is mid-epoch.
    first, _, section = train(tmp_path / "b", 7, final=False)
    assert section["checkpoints"] == 2  # steps 3 and 6
    rest, model, section = train(tmp_path / "b", 14)
    assert section["resumed_from_step"] == 6
    assert min(rest) == 6  # step 6 is run again: the checkpoint is of the state before it
    assert {**first, **rest} == straight_losses
    assert torch.equal(params(model), params(straight_model))


def test_parameters_changed_after_the_snapshot_never_reach_the_checkpoint(tmp_path, monkeypatch):
    # A slow background copy: only the wait before the optimizer step keeps the
    # next update out of the snapshot.
    original = Snapshotter._copy

    def slow_copy(snapshot, deferred):
        time.sleep(0.05)
        original(snapshot, deferred)

    monkeypatch.setattr(Snapshotter, "_copy", staticmethod(slow_copy))
    after_step = {}

    def remember(session, model):
        after_step[session.state.step] = params(model).clone()

    train(tmp_path, 10, every=2, keep=10, on_step=remember)
    manifest = json.loads((tmp_path / "checkpoints" / "manifest.json").read_text())
    steps = [e["step"] for e in manifest["checkpoints"]]
    assert steps == [2, 4, 6, 8, 10]
    for step in steps:
        saved = read_checkpoint(tmp_path / "checkpoints" / f"step-{step:08d}" / "shared.ckpt")
        flat = torch.cat([t.reshape(-1) for k, t in saved["model"].items()])
        # Taken as step `step` starts: the state after steps 0..step-1, not one update more.
        assert torch.equal(flat, after_step[step - 1]), step
        assert step not in after_step or not torch.equal(flat, after_step[step])


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    train(tmp_path, 9, every=3, keep=3)  # checkpoints at 3, 6, 9
    newest = tmp_path / "checkpoints" / "step-00000009" / "shared.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle
    newest.write_bytes(bytes(data))
    with pytest.warns(CheckpointCorruptWarning, match="step 9.*does not match its checksum"):
        _, _, section = train(tmp_path, 9, every=3, keep=3, final=False)
    assert section["resumed_from_step"] == 6
    # Truncation is caught the same way.
    for step in (6, 9):
        path = tmp_path / "checkpoints" / f"step-{step:08d}" / "shared.ckpt"
        path.write_bytes(path.read_bytes()[:1000])
    with pytest.warns(CheckpointCorruptWarning):
        _, _, section = train(tmp_path, 9, every=3, keep=3, final=False)
    assert section["resumed_from_step"] == 3


def test_no_intact_checkpoint_left_is_an_error_that_keeps_them(tmp_path):
    """Every checkpoint damaged (or its step folder removed by hand): the run started
    over as if there had been none, wrote its own steps over them and deleted the rest."""
    train(tmp_path, 7, every=3, final=False)  # steps 3 and 6
    folder = tmp_path / "checkpoints"
    for step in (3, 6):
        path = folder / f"step-{step:08d}" / "shared.ckpt"
        path.write_bytes(path.read_bytes()[:1000])
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    none_intact = r"none of the checkpoints .* is intact \(step\(s\) 3, 6"
    with pytest.warns(CheckpointCorruptWarning), pytest.raises(CheckpointError, match=none_intact):
        train(tmp_path, 12, every=3)
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    _, _, section = train(tmp_path, 12, every=3, resume=False)  # starting over: on purpose
    assert section["resumed_from_step"] is None


@pytest.mark.slow
def test_host_memory_stays_flat_across_many_checkpoints(tmp_path):
    sizes = []

    def measure(session, model):
        if session.state.step % 10 == 0:
            rss_pages = int(Path("/proc/self/statm").read_text().split()[1])
            sizes.append(rss_pages * 4096)

    _, model, section = train(tmp_path, 60, every=1, keep=1, momentum=0.9, on_step=measure)
    assert section["checkpoints"] == 60
    state_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # + momentum
    assert state_bytes <= section["host_buffer_bytes"] < state_bytes * 1.1  # one reused set
    growth = sizes[-1] - sizes[1]
    assert growth < 2 * state_bytes, f"resident memory grew by {growth / 1e6:.1f} MB"
    assert len(list((tmp_path / "checkpoints").glob("step-*"))) == 1


def test_auto_policy_on_known_inputs():
    # Binary fractions keep the arithmetic exact: T = 1/8 s, p = 1/16, p T = 1/128 s.
    auto = AutoInterval(max_overhead=0.0625, profile_steps=3)
    for _ in range(3):
        assert not auto.due(0)
        auto.record_step(0.125)
    assert auto.due(0) and auto.base_step_s == 0.125
    auto.checkpoint_started()
    for seconds in (0.125 + 6 / 128, 0.125, 0.125):  # the checkpoint cost 6/128 s
        auto.record_step(seconds)
    assert not auto.due(3)  # measured alone: nothing starts before its persist is done
    auto.persist_finished(0.25)  # a persist of 2 steps needs k >= 3
    assert auto.interval == 6
    # The budget: 0.796875 s trained so far must grow to (6 + 6) / 128 / p = 1.5 s.
    for _ in range(5):
        auto.record_step(0.125)
    assert not auto.due(8)
    auto.record_step(0.125)
    assert auto.due(9)
    auto.checkpoint_started()
    # A slower window (0.25 s more) raises k to 0.25 s / (p T) = 32; from here on the
    # first window, which also paid for one-time costs, counts in the budget only.
    for seconds in [0.125] * 8 + [0.375, 0.125]:
        auto.record_step(seconds)
    auto.checkpoint_started()
    assert auto.interval == 32
    assert auto.history[-1]["overhead"] == 0.2
    # A machine that slows down as a whole is not blamed on the checkpoint.
    for _ in range(10):
        auto.record_step(0.25)
    auto.checkpoint_started()
    assert auto.history[-1]["cost_s"] == 0.0


@pytest.mark.parametrize("steps", [200, 1000])
def test_auto_policy_keeps_the_whole_run_under_its_bound(steps):
    """A simulated run: each checkpoint costs 45 ms over two 70 ms steps, the first one
    100 ms more (its buffers are allocated), and a persist takes 3 steps."""
    p, step_s, cost_s = 0.035, 0.07, 0.045
    auto = AutoInterval(max_overhead=p)
    extra, persist_in, since, count = [], None, 0, 0
    for _ in range(steps):
        if auto.due(since):
            auto.checkpoint_started()
            extra = [cost_s / 2 + (0.1 if count == 0 else 0.0), cost_s / 2]
            persist_in, since, count = 3, 0, count + 1
        auto.record_step(step_s + (extra.pop(0) if extra else 0.0))
        since += 1
        if persist_in is not None:
            persist_in -= 1
            if persist_in == 0:
                auto.persist_finished(3 * step_s)
                persist_in = None
    overhead = (0.1 + count * cost_s) / (steps * step_s)
    assert overhead <= p
    # ... and spends most of it once the first checkpoint's one-time cost is paid back.
    assert overhead >= (0.5 if steps < 500 else 0.8) * p, (overhead, count)


def test_auto_mode_chooses_an_interval_and_spells_every_auto():
    assert Checkpoint.resolve(1.0, {"every": "auto"})["auto"] is True
    assert [Checkpoint.resolve(i, {})["every"] for i in (0.25, 0.5, 1.0)] == [178, 32, 1]


def test_auto_mode_runs(tmp_path):
    # At full priority the measured checkpoint finishes within a few of these 3 ms steps.
    _, _, section = train(tmp_path, 40, every=1, auto=True, max_overhead=0.05, persist_nice=0)
    assert section["auto_policy"]["interval"] >= 1
    assert section["checkpoints"] >= 2  # the measured first one, then at the chosen interval
    assert section["every"] == section["auto_policy"]["interval"]  # not the unused 1


@contextlib.contextmanager
def tiny_filesystem(folder: Path, mebibytes: int):
    """A filesystem of about ``mebibytes`` MiB mounted on ``folder`` for the block
    (see `mount_tiny_filesystem`); the test fails where none can be mounted, unless
    OVERLAPKIT_ALLOW_NO_FULL_DISK=1 says to skip it."""
    problems = mount_tiny_filesystem(folder, mebibytes)
    if problems:
        reason = "cannot mount a small filesystem (run as root): " + "; ".join(problems)
        if os.environ.get("OVERLAPKIT_ALLOW_NO_FULL_DISK") == "1":
            pytest.skip(reason)
        pytest.fail(f"{reason}. Set OVERLAPKIT_ALLOW_NO_FULL_DISK=1 to skip this test")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], capture_output=True)  # even if busy


def mount_tiny_filesystem(folder: Path, mebibytes: int) -> list[str]:
    """Mount a filesystem of about ``mebibytes`` MiB on ``folder``: a tmpfs, else a
    loop-mounted ext4 or FAT image. Returns what failed, empty once one is mounted."""
    folder.mkdir()

    def run(*command: str) -> str | None:
        try:
            result = subprocess.run(command, capture_output=True, text=True)
        except OSError as error:  # the program is not installed
            return f"{command[0]}: {error.strerror}"
        if result.returncode != 0:
            return f"{' '.join(command)}: {result.stderr.strip() or result.returncode}"
        return None

    failed = run("mount", "-t", "tmpfs", "-o", f"size={mebibytes}m", "tmpfs", str(folder))
    if failed is None:
        return []
    problems = [failed]
    image = folder.with_name(folder.name + ".img")
    # Without a journal and reserved blocks, ext4 leaves about 1 MiB of the image unusable.
    for mkfs in (
        ("mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal"),
        ("mkfs.vfat",),
        ("mkfs.fat",),
    ):
        image.unlink(missing_ok=True)
        with open(image, "wb") as f:
            f.truncate((mebibytes + (1 if mkfs[0] == "mkfs.ext4" else 0)) * 2**20)
        failed = run(*mkfs, str(image)) or run("mount", "-o", "loop", str(image), str(folder))
        if failed is None:
            return []
        problems.append(failed)
    return problems


@pytest.mark.parametrize("on_error", ["stop", "continue"])
def test_a_full_disk_is_reported_and_earlier_checkpoints_survive(tmp_path, on_error):
    disk = tmp_path / "disk"
    with tiny_filesystem(disk, 5):  # each checkpoint is ~2.2 MB: two fit
        run = lambda: train(disk, 12, every=3, keep=3, momentum=0.0, on_error=on_error)  # noqa: E731
        if on_error == "stop":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ResourceWarning)
                with pytest.raises(
                    CheckpointError, match="No space left on device.*earlier checkpoints are intact"
                ):
                    run()
                gc.collect()
            # The failed session closed its step log (not the garbage collector).
            assert not [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        else:
            _, _, section = run()
            assert any("No space left on device" in note for note in section["notes"])
        manifest = json.loads((disk / "checkpoints" / "manifest.json").read_text())
        assert [e["step"] for e in manifest["checkpoints"]] == [3, 6]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # both intact: no corruption warning
            _, _, section = train(disk, 6, every=3, keep=3, momentum=0.0, final=False)
        assert section["resumed_from_step"] == 6


def test_a_read_only_checkpoint_folder_on_two_ranks_is_said_in_one_line(tmp_path, tiny_scenario):
    """Each rank's probe file (which ranks share the folder) was written unguarded: on a
    read-only folder, 'internal error (a bug in overlapkit)', and on_error: continue
    did not continue. Such a folder is now refused before any rank starts, unless
    on_error: continue says to train on (from the checkpoints it holds)."""
    disk = tmp_path / "disk"
    with tiny_filesystem(disk, 20):
        scenario = tiny_scenario(TINY_SCENARIO.replace("nprocs: 1", "nprocs: 2"))

        def run(*sets: str) -> subprocess.CompletedProcess:
            sets = (f"optimizations.checkpoint={{every: 2, dir: {disk}}}", *sets)
            words = [word for s in sets for word in ("--set", s)]
            return run_cli("run", scenario, "--out", tmp_path / "run", "--quiet", *words)

        assert run("train.steps=2").returncode == 0  # checkpoints at 2 and 4
        before = {p: p.read_bytes() for p in disk.rglob("*") if p.is_file()}
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        stopped = run("train.steps=6")  # refused before any rank starts
        assert stopped.returncode == 2, stopped.stderr[-2000:]
        assert f"checkpoint.dir {disk}: {disk} cannot be written" in stopped.stderr
        assert "internal error" not in stopped.stderr and "Traceback" not in stopped.stderr
        went_on = run("train.steps=6", "optimizations.checkpoint.on_error=continue")
        assert went_on.returncode == 0, went_on.stderr[-2000:]
        assert "resumed at step 4" in went_on.stderr
        assert {p: p.read_bytes() for p in disk.rglob("*") if p.is_file()} == before


def test_a_damaged_manifest_is_said_and_its_checkpoints_are_kept(tmp_path, tiny_scenario):
    """A cut manifest read as none: the run started over, said there was nothing to
    resume, and its next checkpoint's clean-up deleted the step folders."""
    train(tmp_path, 7, every=3, final=False)  # steps 3 and 6
    manifest = tmp_path / "checkpoints" / "manifest.json"
    manifest.write_text(manifest.read_text()[:50])
    folders = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert folders == ["step-00000003", "step-00000006"]
    with pytest.raises(CheckpointError, match="manifest.json is damaged.*none is deleted"):
        train(tmp_path, 12, every=3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == folders
    result = run_cli("run", tiny_scenario(), "--out", tmp_path / "run", "--quiet",
                     "--set", "optimizations.checkpoint={every: 2}")  # fmt: skip
    assert result.returncode == 0
    cut = tmp_path / "run" / "checkpoints" / "manifest.json"
    cut.write_text(cut.read_text()[:50])
    again = run_cli("run", tiny_scenario(), "--out", tmp_path / "run",
                    "--set", "optimizations.checkpoint={every: 2}", "--set", "train.steps=9")  # fmt: skip
    assert again.returncode != 0 and "manifest.json is damaged" in again.stderr
    assert "Traceback" not in again.stderr and "internal error" not in again.stderr


def test_step_folders_without_a_manifest_are_kept_aside_and_said(tmp_path):
    """A manifest deleted by hand: the run started over silently, wrote its own step 6
    over the old one and its clean-up deleted step 3. Nothing can check or resume them:
    they are moved aside whole, and the run says so."""
    train(tmp_path, 7, every=3, final=False)  # steps 3 and 6
    folder = tmp_path / "checkpoints"
    old = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    (folder / "manifest.json").unlink()
    del old[Path("manifest.json")]
    with pytest.warns(UserWarning, match="step folders but no manifest.json") as said:
        losses, _, section = train(tmp_path, 7, every=3, final=False)
    (aside,) = tmp_path.glob("checkpoints.old-*")
    assert str(aside) in str(said[0].message)
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == old
    assert min(losses) == 0  # started over, at its first step
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-00000003", "step-00000006"]


@pytest.mark.parametrize(
    "edited",
    [
        {"checkpoints": [{"step": "6", "files": {}}]},
        {"checkpoints": [{"step": 6}]},
        {"checkpoints": [6]},
        {"checkpoints": [{"step": 6, "files": ["shared.ckpt"]}]},
    ],
)
def test_a_manifest_edited_into_another_shape_is_said_as_damaged(tmp_path, edited):
    """Only a missing "step" was caught: a step as text, or no "files", ended in an
    internal error (TypeError, KeyError) where a cut manifest is one clear line."""
    train(tmp_path, 7, every=3, final=False)
    (tmp_path / "checkpoints" / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match="manifest.json is damaged.*none is deleted"):
        train(tmp_path, 12, every=3)
    assert len(list((tmp_path / "checkpoints").glob("step-*"))) == 2


def test_the_cli_says_a_corrupt_checkpoint_was_skipped_in_one_line(tmp_path, tiny_scenario):
    """It printed Python's warning dump: a file path, a line number and a source line."""
    out = tmp_path / "run"
    every = ["--set", "optimizations.checkpoint={every: 2, final: false}", "--quiet"]
    assert run_cli("run", tiny_scenario(), "--out", out, *every).returncode == 0
    newest = max((out / "checkpoints").glob("step-*")) / "shared.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    again = run_cli("run", tiny_scenario(), "--out", out, *every, "--set", "train.steps=9")
    assert again.returncode == 0, again.stderr[-2000:]
    lines = [line for line in again.stderr.splitlines() if "skipping the checkpoint" in line]
    assert len(lines) == 1 and lines[0].startswith("overlapkit: warning: skipping"), again.stderr
    assert "CheckpointCorruptWarning" not in again.stderr and "restore.py" not in again.stderr


def test_an_unwritable_checkpoint_folder_is_a_clear_error(tmp_path, tiny_scenario):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    # Found when the session is made, before any step (a file where a folder would be).
    with pytest.raises(CombinationError, match="a-file is a file; name a folder"):
        train(tmp_path, 3, dir=str(blocker / "checkpoints"))
    result = run_cli(
        "run",
        tiny_scenario(),
        "--out",
        tmp_path / "run",
        "--set",
        f"optimizations.checkpoint={{every: 2, dir: {blocker}/ck}}",
        timeout=60,
    )
    assert result.returncode == 2  # before any rank starts
    assert "is a file; name a folder" in result.stderr and "Traceback" not in result.stderr
    assert blocker.read_text() == "not a folder"


@pytest.mark.slow
def test_two_rank_run_killed_and_resumed_matches_an_uninterrupted_one(tiny_scenario, tmp_path):
    common = [
        "--quiet",
        "--set",
        "world.nprocs=2",
        "--set",
        "train.steps=14",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "optimizations.ddp_overlap.intensity=1",
        "--set",
        "optimizations.checkpoint={every: 4, keep: 10}",
    ]
    straight = run_cli("run", tiny_scenario(), "--out", tmp_path / "a", *common)
    assert straight.returncode == 0, straight.stderr[-2000:]
    # The bytes written are every rank's files of every checkpoint, as the manifest lists them.
    written = json.loads((tmp_path / "a" / "summary.json").read_text())["optimizations"]
    entries = json.loads((tmp_path / "a" / "checkpoints" / "manifest.json").read_text())
    entries = entries["checkpoints"]
    assert len(entries) == written["checkpoint"]["checkpoints"]
    assert {"rank00000.ckpt", "rank00001.ckpt"} <= set(entries[0]["files"])
    assert written["checkpoint"]["bytes_written"] == sum(
        record["bytes"] for entry in entries for record in entry["files"].values()
    )
    crashed = run_cli(
        "run",
        tiny_scenario(),
        "--out",
        tmp_path / "b",
        *common,
        "--set",
        "optimizations.toy_fail={rank: 1, step: 9, how: sigkill}",
    )
    assert crashed.returncode == 1 and "died with SIGKILL" in crashed.stderr
    resumed = run_cli("run", tiny_scenario(), "--out", tmp_path / "b", *common)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    # Killed as step 9 started, the step-8 checkpoint may not be durable on both ranks yet.
    resumed_from = summary["optimizations"]["checkpoint"]["resumed_from_step"]
    assert resumed_from in (4, 8)
    steps = {}
    for name in ("a", "b"):
        lines = (tmp_path / name / "steps.jsonl").read_text().splitlines()
        steps[name] = {(r["step"], r["rank"]): r["loss"] for r in map(json.loads, lines)}
    assert set(steps["b"]) == {(s, r) for s in range(resumed_from, 14) for r in (0, 1)}
    assert all(steps["a"][key] == loss for key, loss in steps["b"].items())
    final = [
        read_checkpoint(tmp_path / n / "checkpoints" / "step-00000014" / "shared.ckpt")
        for n in ("a", "b")
    ]
    assert all(torch.equal(final[0]["model"][k], final[1]["model"][k]) for k in final[0]["model"])
    rank1 = [
        read_checkpoint(tmp_path / n / "checkpoints" / "step-00000014" / "rank00001.ckpt")
        for n in ("a", "b")
    ]
    assert rank1[0]["loader"] == rank1[1]["loader"]
    assert torch.equal(rank1[0]["rng"]["torch"], rank1[1]["rng"]["torch"])


def test_pruning_never_touches_checkpoints_other_ranks_are_still_writing(tmp_path):
    from overlapkit.optimizations.checkpoint.store import Manifest, step_dir

    for step in (2, 3, 4, 6):  # 3: a crash leftover; 6: another rank is writing it now
        step_dir(tmp_path, step).mkdir(parents=True)
    manifest = Manifest(tmp_path)
    manifest.add({"step": 2, "files": {}}, keep=1)
    manifest.add({"step": 4, "files": {}}, keep=1)
    assert [e["step"] for e in manifest.read()] == [4]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000004", "step-00000006"]


@pytest.mark.slow
def test_each_shard_is_written_once_and_restored_to_its_own_ranks(tmp_path):
    """The layout for pipeline stages: one replicated file per shard, one manifest."""
    from rank_programs import stage_shards

    first = launch_local(stage_shards, 2, str(tmp_path), 4)
    step = json.loads((tmp_path / "checkpoints" / "manifest.json").read_text())["checkpoints"][-1]
    assert step["step"] == 4
    assert sorted(step["files"]) == [
        "rank00000.ckpt",
        "rank00001.ckpt",
        "stage000.ckpt",
        "stage001.ckpt",
    ]
    assert not torch.equal(first[0]["params"], first[1]["params"])
    again = launch_local(stage_shards, 2, str(tmp_path), 4)  # resumes at the end: no steps
    for rank in (0, 1):
        assert again[rank]["resumed_from"]["resumed_from_step"] == 4
        assert torch.equal(again[rank]["params"], first[rank]["params"])


def test_resume_false_starts_over_and_keeps_the_old_checkpoints_aside(tmp_path):
    first, _, _ = train(tmp_path, 4, every=2)
    again, _, section = train(tmp_path, 4, every=2, resume=False)
    assert section["resumed_from_step"] is None
    assert sorted(again) == [0, 1, 2, 3] and again == first  # from step 0, the same run
    (aside,) = tmp_path.glob("checkpoints.old-*")
    assert json.loads((aside / "manifest.json").read_text())["checkpoints"][-1]["step"] == 4
    assert (tmp_path / "checkpoints" / "manifest.json").exists()


def test_run_fresh_and_resume_false_start_over_and_keep_the_old_checkpoints(
    tiny_scenario, tmp_path, capsys
):
    from overlapkit.cli import main

    out = tmp_path / "run"
    command = [
        "run", str(tiny_scenario()), "--out", str(out), "--quiet",
        "--set", "optimizations.checkpoint={every: 2}",
        "--set", "train.steps=4",
        "--set", "train.warmup_steps=0",
    ]  # fmt: skip

    def ran(*extra: str) -> tuple[list[float], int | None]:
        assert main([*command, *extra]) == 0, capsys.readouterr().err
        lines = (out / "steps.jsonl").read_text().splitlines()
        summary = json.loads((out / "summary.json").read_text())
        losses = [json.loads(line)["loss"] for line in lines]
        return losses, summary["optimizations"]["checkpoint"]["resumed_from_step"]

    first, resumed_from = ran()
    assert len(first) == 4 and resumed_from is None
    # The same command would resume from the final checkpoint and train nothing: refused,
    # the finished run's results left as they were.
    assert main(command) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert len((out / "steps.jsonl").read_text().splitlines()) == 4
    assert ran("--fresh") == (first, None)  # starts over: the same run again
    (aside,) = out.glob("checkpoints.old-*")
    # Within the same second too: the second folder moved aside gets a name of its own.
    assert ran("--set", "optimizations.checkpoint.resume=false") == (first, None)
    assert len(list(out.glob("checkpoints.old-*"))) == 2
    for folder in (aside, out / "checkpoints"):  # each run's own checkpoints, to its end
        manifest = json.loads((folder / "manifest.json").read_text())
        assert [e["step"] for e in manifest["checkpoints"]] == [2, 4]
    # A manifest deleted by hand: --fresh moved nothing aside and the new run wrote over
    # the step folders. They are kept aside as they were.
    (out / "checkpoints" / "manifest.json").unlink()
    held = out / "checkpoints"
    kept = {p.relative_to(held): p.read_bytes() for p in held.glob("step-*/*")}
    earlier = set(out.glob("checkpoints.old-*"))
    assert ran("--fresh") == (first, None)
    (moved,) = set(out.glob("checkpoints.old-*")) - earlier
    assert {p.relative_to(moved): p.read_bytes() for p in moved.glob("step-*/*")} == kept


@pytest.fixture
def slow_persists(monkeypatch):
    """Every persist takes ``seconds`` longer (a slow disk)."""

    def slow_down(seconds):
        persist = Persister._persist

        def slow(self, snapshot):
            time.sleep(seconds)
            persist(self, snapshot)

        monkeypatch.setattr(Persister, "_persist", slow)

    return slow_down


def test_each_checkpoint_has_its_own_stall_while_an_earlier_one_persists(tmp_path, slow_persists):
    slow_persists(0.3)  # far longer than 2 steps: each snapshot starts while one persists
    sessions = []
    _, _, section = train(
        tmp_path, 8, every=2, final=False, on_step=lambda s, m: sessions.append(s)
    )
    assert section["checkpoints"] == 3  # steps 2, 4, 6
    stalled = sum(r["phases_s"]["ckpt_stall"] for r in sessions[-1].records)
    assert section["stall_s_mean"] == pytest.approx(stalled / 3, rel=0.05)


def test_auto_mode_measures_a_first_checkpoint_that_outlasts_the_run(tmp_path, slow_persists):
    slow_persists(0.5)
    _, _, section = train(tmp_path, 12, auto=True, final=False)
    assert section["checkpoints"] == 1
    policy = section["auto_policy"]
    assert len(policy["history"]) == 1  # its window, closed at the end of the run
    assert policy["interval"] >= 1 and policy["measured_overhead"] >= 0


def test_a_checkpoint_at_the_last_step_counts_in_the_stall(tmp_path):
    # Steps 0-3: the one checkpoint is taken at the start of step 3, the run's last;
    # its persist is still in flight when the run ends.
    _, _, section = train(tmp_path, 4, every=3, final=False)
    assert section["checkpoints"] == 1
    assert section["stall_s_mean"] > 0

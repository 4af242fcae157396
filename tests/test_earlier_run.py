"""A run into a folder an earlier run left: resumed only when the checkpoints are of
the same setup and there is something left to train; otherwise refused before any
rank starts, the folder left as it was. One real finished run, copied per case."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from conftest import TINY_SCENARIO, cli_here
from overlapkit import Session, get_optimization
from overlapkit.cli import _earlier_runs
from overlapkit.earlier_run import (
    EarlierRunError,
    ScheduleWarning,
    check_earlier_run,
)
from overlapkit.optimizations.checkpoint import CheckpointError
from overlapkit.optimizations.checkpoint.setup import setup_changes
from overlapkit.run import run_scenario
from overlapkit.scenarios import dump_scenario, load_scenario

CHECKPOINTED = TINY_SCENARIO + "optimizations: {checkpoint: {every: 2}}\n"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run of the tiny scenario (6 steps after 2 of warm-up), checkpointed."""
    folder = tmp_path_factory.mktemp("earlier")
    scenario = folder / "tiny.yaml"
    scenario.write_text(CHECKPOINTED)
    result = cli_here("run", scenario, "--out", folder / "run", "--quiet")
    assert result.returncode == 0, result.stderr
    return folder / "run"


@pytest.fixture
def earlier(finished, tmp_path, tiny_scenario):
    """A copy of the finished run, and a function running the tiny scenario (with
    ``text`` and ``--set`` overrides) into it."""
    folder = tmp_path / "run"
    shutil.copytree(finished, folder)

    def run(*overrides: str, text: str = CHECKPOINTED, flags: tuple[str, ...] = ()):
        sets = [word for override in overrides for word in ("--set", override)]
        path = tiny_scenario(text, name="again.yaml")
        return cli_here("run", path, "--out", folder, "--quiet", *sets, *flags)

    return folder, run


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_resuming_a_finished_run_is_refused_and_loses_nothing(earlier):
    folder, run = earlier
    before = snapshot(folder)
    result = run()
    assert result.returncode == 2
    assert "nothing to resume" in result.stderr and "already trained 8 steps" in result.stderr
    assert snapshot(folder) == before
    trained_on = run("train.steps=10")  # more steps: it resumes at 8 and trains on
    assert trained_on.returncode == 0, trained_on.stderr
    summary = yaml.safe_load((folder / "summary.json").read_text())
    assert summary["optimizations"]["checkpoint"]["resumed_from_step"] == 8


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model.width=8", "model.width 4 -> 8"),
        ("train.optimizer.name=adam", "train.optimizer.name sgd -> adam"),
        ("train.batch_size=4", "train.batch_size 8 -> 4"),
        ("data.num_samples=128", "data.num_samples 256 -> 128"),
    ],
)
def test_checkpoints_of_another_setup_are_not_loaded(earlier, override, named):
    folder, run = earlier
    before = snapshot(folder)
    result = run(override, "train.steps=10")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"holds checkpoints of another setup ({named})" in result.stderr
    assert f"--out {folder} --fresh" in result.stderr
    assert snapshot(folder) == before  # its scenario.yaml too


TWO_RANKS = CHECKPOINTED.replace("world: {nprocs: 1}", "world: {nprocs: 2}")
PIPELINED = TWO_RANKS.replace("{every: 2}}", "{every: 2}, pipeline: {stages: 2, microbatches: 2}}")


@pytest.mark.parametrize(
    ("before", "now", "named"),
    [
        (
            TWO_RANKS,
            PIPELINED,
            "optimizations.pipeline off -> stages=2 stages_per_rank=1 split=auto",
        ),
        (
            PIPELINED,
            TWO_RANKS,
            "optimizations.pipeline stages=2 stages_per_rank=1 split=auto -> off",
        ),
        (PIPELINED, PIPELINED.replace("stages: 2,", "stages: 2, intensity: 0,"), "-> off"),
        (
            PIPELINED,
            PIPELINED.replace("stages: 2,", "stages: 2, split: equal,"),
            "split auto -> equal",
        ),
    ],
)
def test_checkpoints_of_another_pipeline_layout_are_not_loaded(tiny_scenario, before, now, named):
    """A pipeline turned on or off, or split elsewhere, passed this check: its ranks
    skipped every checkpoint (a stage's file not in the manifest) and trained from step
    0 over them, or failed loading a stage's layers (an internal error)."""
    folder = tiny_scenario("").parent / "run"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "scenario.yaml").write_text(dump_scenario(load_scenario(tiny_scenario(before))))
    manifest = '{"format": 1, "checkpoints": [{"step": 4, "world_size": 2, "files": {}}]}'
    (folder / "checkpoints" / "manifest.json").write_text(manifest)
    with pytest.raises(EarlierRunError, match="holds checkpoints of another setup") as refused:
        check_earlier_run(folder, load_scenario(tiny_scenario(now, name="now.yaml")), fresh=False)
    assert named in str(refused.value)
    same = before.replace("microbatches: 2", "microbatches: 4")  # not saved: trains on
    check_earlier_run(folder, load_scenario(tiny_scenario(same, name="same.yaml")), fresh=False)


def test_a_finished_run_is_not_written_over_unless_asked(earlier):
    folder, run = earlier
    before = snapshot(folder)
    plain = run(text=TINY_SCENARIO)  # nothing to resume: it would train from step 0
    assert plain.returncode == 2 and "holds the results of a finished run" in plain.stderr
    assert snapshot(folder) == before
    assert run(text=TINY_SCENARIO, flags=("--fresh",)).returncode == 0


def test_resume_finds_only_its_own_scenarios_folders(tmp_path):
    for folder, name in (
        ("tiny-wide-20261123-100000", "tiny-wide"),
        ("tiny-20261123-090000", "tiny"),
    ):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "scenario.yaml").write_text(f"name: {name}\n")
    assert _earlier_runs("tiny", tmp_path) == [tmp_path / "tiny-20261123-090000"]
    assert _earlier_runs("tiny-wide", tmp_path) == [tmp_path / "tiny-wide-20261123-100000"]


def test_setup_changes_name_the_first_key_that_differs():
    before = yaml.safe_load(CHECKPOINTED)
    after = yaml.safe_load(CHECKPOINTED)
    after["model"]["stem"] = "imagenet"
    after["train"]["steps"] = 100  # training on: not a change of setup
    after["train"]["optimizer"]["lr"] = 0.01  # nor a new learning rate
    assert setup_changes(before, after) == ["model.stem cifar -> imagenet"]


def test_checkpoints_in_a_shared_folder_are_checked_against_their_own_setup(tmp_path):
    """An absolute checkpoint.dir shared by several run folders skipped the check (it
    read only the run folder's scenario.yaml): a new --out with another seed resumed
    seed 0's checkpoints and exited 0; another width was an internal error listing
    every tensor. The setup is now recorded in the checkpoints' manifest."""
    shared = tmp_path / "shared"
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(
        TINY_SCENARIO + f"optimizations: {{checkpoint: {{every: 2, dir: {shared}}}}}\n"
    )
    first = cli_here("run", scenario, "--out", tmp_path / "a", "--quiet")
    assert first.returncode == 0, first.stderr
    before = snapshot(shared)
    for override, named in (
        ("train.seed=5", "train.seed 0 -> 5"),
        ("model.width=8", "model.width 4 -> 8"),
    ):
        for out in (("--out", tmp_path / "b"), ()):  # a new folder, named or not
            again = cli_here(
                "run", scenario, *out, "--quiet", "--set", override, "--set", "train.steps=10",
                cwd=tmp_path,
            )  # fmt: skip
            assert again.returncode == 2, again.stderr
            assert f"{shared} holds checkpoints of another setup ({named})" in again.stderr
            assert "internal error" not in again.stderr and "--fresh" in again.stderr
            assert snapshot(shared) == before
            assert not (tmp_path / "b").exists() and not (tmp_path / "runs").exists()
    # Through the Python API (no command line to check first): the ranks refuse.
    seeded = load_scenario(scenario, ["train.seed=5", "train.steps=10"])
    with pytest.raises(CheckpointError, match="holds checkpoints of another setup") as refused:
        run_scenario(seeded, tmp_path / "c", progress=False, print_summary=False)
    # named as the command line names it (the same comparison), with the same way out
    assert "(train.seed 0 -> 5)" in str(refused.value), refused.value
    assert "overlapkit run --fresh" in str(refused.value)
    assert snapshot(shared) == before
    same = cli_here("run", scenario, "--out", tmp_path / "d", "--quiet", "--set", "train.steps=10")
    assert same.returncode == 0, same.stderr  # the same setup trains on
    assert "resumed at step 8" in same.stderr


def test_a_script_resuming_checkpoints_of_another_model_gets_a_clear_error(tmp_path):
    """A Session of a script's own knows no scenario: checkpoints of another model are
    refused by their tensors, as a `CheckpointError` naming the folder."""

    def session_run(width: int, steps: int, groups: int = 1) -> None:
        model = torch.nn.Linear(width, 2)
        params = [[model.weight, model.bias]] if groups == 1 else [[model.weight], [model.bias]]
        optimizer = torch.optim.SGD([{"params": p} for p in params], lr=0.1)
        session = Session([get_optimization("checkpoint")(every=2)], run_dir=tmp_path)
        batches = [torch.ones(4, width)] * 3
        model, optimizer, batches = session.prepare(model, optimizer, batches)
        for inputs in session.steps(steps):
            with session.forward():
                loss = model(inputs).sum()
            session.backward(loss)
            session.optimizer_step()
        session.finish()

    session_run(width=3, steps=4)
    with pytest.raises(CheckpointError, match="does not fit this run") as refused:
        session_run(width=5, steps=6)
    assert str(tmp_path / "checkpoints") in str(refused.value)
    # What differs, as torch says it (its first line named only the module's class).
    assert "size mismatch for weight" in str(refused.value)
    # Another optimizer's parameter groups: torch's ValueError was a traceback.
    with pytest.raises(CheckpointError, match="different number of parameter groups"):
        session_run(width=3, steps=6, groups=2)


def test_resuming_a_cosine_schedule_with_more_steps_warns_that_its_rest_changes(
    tiny_scenario, recwarn
):
    """A cosine (or linear) schedule decays over the run's total steps: raised on resume,
    the remaining steps silently followed another schedule."""
    cosine = CHECKPOINTED.replace("  seed: 0\n", "  seed: 0\n  lr_schedule: {name: cosine}\n")
    folder = tiny_scenario("").parent / "run"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "scenario.yaml").write_text(dump_scenario(load_scenario(tiny_scenario(cosine))))
    manifest = '{"format": 1, "checkpoints": [{"step": 8, "world_size": 1, "files": {}}]}'
    (folder / "checkpoints" / "manifest.json").write_text(manifest)
    longer = load_scenario(tiny_scenario(cosine, name="now.yaml"), ["train.steps=10"])
    with pytest.warns(ScheduleWarning, match="cosine learning-rate schedule decays over 12"):
        check_earlier_run(folder, longer, fresh=False)
    constant = load_scenario(tiny_scenario(CHECKPOINTED, name="c.yaml"), ["train.steps=10"])
    check_earlier_run(folder, constant, fresh=False)  # nothing decays: no word
    assert not [w for w in recwarn if w.category is ScheduleWarning]

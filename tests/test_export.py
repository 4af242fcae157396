"""overlapkit export: a run's model out of its checkpoints as one plain file (a
torch state_dict with the model's own names), from the newest intact checkpoint,
and one line for what cannot be exported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from overlapkit.export import ExportError, tensorflow_arrays, unsplit_name
from overlapkit.optimizations.checkpoint import fileformat
from overlapkit.scenarios.loader import load_scenario


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """The tiny scenario run with checkpoints at steps 2, 4 and 6."""
    from conftest import TINY_SCENARIO

    folder = tmp_path_factory.mktemp("export")
    scenario = folder / "scenario-file.yaml"
    scenario.write_text(TINY_SCENARIO)
    out = folder / "run"
    result = run_cli(
        "run", scenario, "--out", out, "--quiet", "--set", "optimizations.checkpoint={every: 2}"
    )
    assert result.returncode == 0, result.stderr
    return out


def steps_of(folder):
    return [e["step"] for e in json.loads((folder / "manifest.json").read_text())["checkpoints"]]


def test_the_newest_checkpoint_is_exported_as_a_state_dict_the_model_loads(run_folder):
    result = run_cli("export", run_folder)
    assert result.returncode == 0, result.stderr
    newest = steps_of(run_folder / "checkpoints")[-1]
    path = run_folder / f"model-step-{newest}.pt"
    assert f"wrote {path}: the model at step {newest}" in result.stdout
    assert "model.load_state_dict(torch.load(" in result.stdout
    state = torch.load(path)
    model = load_scenario(run_folder / "scenario.yaml").model.build()
    model.load_state_dict(state)  # strict: the model's own names, nothing missing
    saved = fileformat.read(run_folder / "checkpoints" / f"step-{newest:08d}" / "shared.ckpt")
    assert state.keys() == saved["model"].keys()
    assert all(torch.equal(state[k], saved["model"][k]) for k in state)


def test_a_run_that_trained_past_its_newest_checkpoint_is_said_so(run_folder, tmp_path):
    """A run with no final checkpoint (checkpoint.final: false, or stopped between two):
    export wrote the newest checkpoint's model with no word that the run's own model,
    8 steps trained, is not that one."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_folder, copy)
    manifest = copy / "checkpoints" / "manifest.json"
    document = json.loads(manifest.read_text())
    document["checkpoints"] = document["checkpoints"][:-1]  # as if no final one
    manifest.write_text(json.dumps(document))
    newest = steps_of(copy / "checkpoints")[-1]
    result = run_cli("export", copy)
    assert result.returncode == 0, result.stderr
    assert f"the model at step {newest}" in result.stdout
    assert "note: the run trained on to step 8, past this checkpoint" in result.stdout
    said = run_cli("export", copy, "--json", "--to", tmp_path / "m.pt")
    assert json.loads(said.stdout)["trained_to"] == 8
    assert "note:" not in run_cli("export", run_folder, "--to", tmp_path / "n.pt").stdout
    (copy / "steps.jsonl").unlink()  # a run killed: only its live log
    said = run_cli("export", copy, "--json", "--to", tmp_path / "m.pt")
    assert json.loads(said.stdout)["trained_to"] == 8


def test_a_damaged_newest_checkpoint_is_skipped_and_said(run_folder, tmp_path):
    import shutil

    copy = tmp_path / "checkpoints"
    shutil.copytree(run_folder / "checkpoints", copy)
    *older, newest = steps_of(copy)
    shared = copy / f"step-{newest:08d}" / "shared.ckpt"
    shared.write_bytes(shared.read_bytes()[:-100])
    result = run_cli("export", copy, "--to", tmp_path / "m.pt")
    assert result.returncode == 0, result.stderr
    assert f"skipped the newer checkpoint at step {newest}: " in result.stdout
    assert "does not match its checksum" in result.stdout
    assert f"the model at step {older[-1]}" in result.stdout
    asked = run_cli("export", copy, "--step", str(newest))
    assert asked.returncode == 2 and "no intact checkpoint" in asked.stderr


@pytest.mark.parametrize(
    "args, said",
    [
        (["{tmp}/nowhere"], "no such run folder"),
        (["{tmp}"], "holds no checkpoint"),
        (["{run}", "--step", "5"], "holds no checkpoint at step 5 (it holds: 6, 8)"),
        (["{run}", "--to", "{tmp}"], "a folder; name the file to write"),
        (["{run}", "--to", "{tmp}/no/such/model.pt"], "does not exist"),
        (["{run}", "--to", "{tmp}/model.npz"], "a torch run exports a torch state_dict; name"),
        # The run's summary was overwritten by the model; a step's folder was "no
        # checkpoint: the run needs the checkpoint optimization"; a failed write named
        # the temporary file beside the one asked for.
        (["{run}", "--to", "{run}/summary.json"], "a file that no export wrote"),
        (["{run}/checkpoints/step-00000008"], "overlapkit export {run}/checkpoints --step 8"),
        pytest.param(
            ["{run}", "--to", "/proc/model.pt"],
            "/proc/model.pt: cannot be written",
            marks=pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc"),
        ),
    ],
)
def test_what_cannot_be_exported_is_one_line(run_folder, tmp_path, args, said):
    words = [a.format(tmp=tmp_path, run=run_folder) for a in args]
    summary = (run_folder / "summary.json").read_bytes()
    result = run_cli("export", *words)
    assert result.returncode == 2, result.stderr
    assert said.format(run=run_folder) in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert (run_folder / "summary.json").read_bytes() == summary


def test_a_pipeline_stages_names_are_the_unsplit_models():
    names = {"layer1_0": "layer1.0", "head": "head", "0": "0"}
    assert unsplit_name("layers.layer1_0.conv1.weight", names) == "layer1.0.conv1.weight"
    assert unsplit_name("1.layers.head.2.bias", names) == "head.2.bias"  # 2 stages a rank
    assert unsplit_name("layers.0.weight", names) == "0.weight"  # an nn.Sequential
    with pytest.raises(ExportError, match="names no recorded layer"):
        unsplit_name("layers.layer9_9.weight", names)


def test_tensorflow_arrays_are_named_by_their_paths_unless_the_checkpoint_cannot_say():
    a, b = torch.zeros(1), torch.ones(2)
    assert tensorflow_arrays([a, b], ["dense/kernel", "dense/bias"]) == {
        "dense/kernel": a,
        "dense/bias": b,
    }
    by_position = {"0000": a, "0001": b}
    assert tensorflow_arrays([a, b], None) == by_position  # an older checkpoint
    assert tensorflow_arrays([a, b], ["seed", "seed"]) == by_position  # a name twice


def test_a_compiled_models_export_has_the_models_own_names(tmp_path):
    """torch.compile's wrapper names every parameter _orig_mod.NAME: the export of a
    script that compiled its model did not load into the model itself."""
    from torch import nn

    from overlapkit import Session

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    compiled = torch.compile(model, backend="eager")
    session = Session()
    session.prepare(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1))
    session.save(tmp_path / "saved")
    session.finish()
    result = run_cli("export", tmp_path / "saved", "--to", tmp_path / "m.pt")
    assert result.returncode == 0, result.stderr
    state = torch.load(tmp_path / "m.pt")
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert torch.equal(state["2.weight"], model[2].weight)


def test_a_fresh_ray_run_moves_aside_every_machines_checkpoints(tmp_path):
    """A run --ray --fresh over 2 machines moved aside node 1's checkpoints but left
    those of an earlier run over 3 (nodes/node2): an export would have taken that
    run's stage files for this one's."""
    from overlapkit.launch.ray_run import _move_aside

    machines = [tmp_path, tmp_path / "nodes" / "node1", tmp_path / "nodes" / "node2"]
    for folder in machines:
        (folder / "checkpoints").mkdir(parents=True)
    _move_aside(tmp_path, 2)
    for folder in machines:
        assert not (folder / "checkpoints").exists()
        assert [p.name.startswith("checkpoints.old-") for p in folder.glob("checkpoints*")] == [
            True
        ]

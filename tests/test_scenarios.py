"""Scenario files: parsing, overrides, and a specific message for each kind of bad input."""

from pathlib import Path

import pytest

from conftest import ROOT, TINY_SCENARIO, cli_here
from overlapkit.scenarios import ScenarioError, dump_scenario, load_scenario


def errors_of(path, overrides=()):
    with pytest.raises(ScenarioError) as error:
        load_scenario(path, overrides)
    return str(error.value)


def test_the_design_example_loads_with_overrides(tiny_scenario):
    scenario = load_scenario(
        tiny_scenario(),
        ["world.nprocs=2", "train.optimizer.lr=0.5", "optimizations.toy_probe.intensity=0.5"],
    )
    assert scenario.world.nprocs == 2
    assert scenario.train.optimizer.lr == 0.5
    assert scenario.train.total_steps == 8
    assert [o.name for o in scenario.build_optimizations()] == ["toy_probe"]
    assert scenario.build_optimizations()[0].settings["depth"] == 4
    # The resolved scenario round-trips.
    again = tiny_scenario(dump_scenario(scenario), "again.yaml")
    assert load_scenario(again) == scenario


def test_intensity_zero_turns_an_optimization_off(tiny_scenario):
    scenario = load_scenario(tiny_scenario(), ["optimizations.toy_probe.intensity=0"])
    assert scenario.build_optimizations() == []
    # Also one the file configures (--set optimizations.pipeline.intensity=0 over a
    # pipeline with stages set kept it running), as a tune's trials do.
    configured = ["optimizations.checkpoint={every: 5, keep: 3}"]
    scenario = load_scenario(tiny_scenario(), [*configured, "optimizations.checkpoint.intensity=0"])
    assert scenario.build_optimizations() == []
    # A mode at 0 (ddp_overlap's no-overlap baseline) stays.
    scenario = load_scenario(tiny_scenario(), ["optimizations.ddp_overlap={intensity: 0}"])
    assert [o.name for o in scenario.build_optimizations()] == ["ddp_overlap"]


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            {"train": "  batch_sise: 8"},
            ":6: train.batch_sise: unknown key 'batch_sise' (did you mean 'batch_size'?)",
        ),
        ({"train": "  steps: many"}, ":6: train.steps: Input should be a valid integer"),
        (
            {"train": "  steps: 0"},
            ":6: train.steps: Input should be greater than or equal to 1, got 0",
        ),
        (
            {"model": "model: {name: resnet81}"},
            ":2: model.name: unknown model 'resnet81' (did you mean 'resnet18'?) (allowed: resnet18, resnet50, bert)",
        ),
        (
            {"world": "world: {nprocs: 1, device: tpu}"},
            "world.device: Input should be 'auto', 'cpu' or 'cuda'",
        ),
        (
            {"opt": "optimizations: {toy_probe: {depth: 99}}"},
            "optimizations.toy_probe.depth: depth=99 is out of range: allowed 1 to 16",
        ),
        (
            {"opt": "optimizations: {toy_probe: {intensity: 2}}"},
            "optimizations.toy_probe.intensity: intensity=2 is out of range: allowed 0 to 1",
        ),
        (
            {"opt": "optimizations: {toy_probe: {mode: z}}"},
            "optimizations.toy_probe.mode: mode='z' is not allowed: choose one of ['a', 'b', 'c']",
        ),
        (
            {"opt": "optimizations: {toy_prob: {}}"},
            "optimizations.toy_prob: unknown optimization 'toy_prob' (did you mean 'toy_probe'?)",
        ),
        (
            {"model": "model: {name: bert, num_classes: 4}"},
            "model.name: model bert reads tokens but data synthetic-images yields images",
        ),
        (
            {"model": "model: {name: resnet18, num_classes: 3}"},
            "model.num_classes: model.num_classes is 3 but data synthetic-images has 4 classes",
        ),
    ],
)
def test_each_bad_value_names_file_line_key_and_what_is_allowed(tiny_scenario, edit, expected):
    lines = [
        "name: tiny",
        "model: {name: resnet18, stem: cifar, num_classes: 4, width: 4}",
        "data: {name: synthetic-images, shape: [3, 16, 16], num_classes: 4, num_samples: 256}",
        "train:",
        "  batch_size: 8",
        "  steps: 2",
        "world: {nprocs: 1}",
    ]
    if "train" in edit:
        lines[5] = edit["train"]
    if "model" in edit:
        lines[1] = edit["model"]
    if "world" in edit:
        lines[6] = edit["world"]
    if "opt" in edit:
        lines.append(edit["opt"])
    path = tiny_scenario("\n".join(lines) + "\n")
    message = errors_of(path)
    assert str(path) in message
    assert expected in message


def test_override_errors_name_the_override(tiny_scenario):
    message = errors_of(tiny_scenario(), ["train.batch_size=-3"])
    assert (
        "--set train.batch_size=-3: train.batch_size: Input should be greater than or equal to 1"
        in message
    )
    assert "expected KEY=VALUE" in errors_of(tiny_scenario(), ["train.steps"])
    # A list or mapping left open: said as YAML, not as "Input should be a valid tuple".
    message = errors_of(tiny_scenario(), ["data.shape=[3,32,32"])
    assert "--set data.shape=[3,32,32: [3,32,32 is not valid YAML (expected" in message


def test_structural_problems(tmp_path):
    assert "scenario file not found" in errors_of(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: [1, 2\n")
    assert f"{bad}:3: not valid YAML" in errors_of(bad)
    bad.write_text("- just\n- a list\n")
    assert "must be a mapping of sections, this file is a list" in errors_of(bad)
    bad.write_text("name: a\nname: b\n")
    assert "line 2: duplicate key 'name'" in errors_of(bad)
    bad.write_text("name: a\nmodel: !!python/object/apply:os.system ['true']\n")
    assert "not valid YAML" in errors_of(bad)  # loaded safely: no object construction


def test_every_shipped_scenario_is_valid():
    files = sorted((ROOT / "scenarios").glob("*.yaml"))
    assert len(files) >= 6
    for path in files:
        load_scenario(path)


def test_the_overrides_each_scenario_header_gives_load_as_written():
    """The headers' "Real data: --set data.name=cifar10 --set data.root=..." lines were
    refused ("data.shape: unknown key 'shape'"): the synthetic data's keys stayed. A
    --set of a section's name that changes its kind drops the keys only the earlier
    kind takes."""
    import shlex

    tried = 0
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        for line in path.read_text().splitlines():
            if line.startswith("#") and ": --set " in line:
                words = shlex.split(line.split(":", 1)[1].split(" (")[0])
                overrides = [w for w in words if w != "--set"]
                scenario = load_scenario(path, overrides)
                tried += 1
                for override in overrides:
                    key, _, value = override.partition("=")
                    if key == "data.name":
                        assert scenario.data.name == value
    assert tried >= 8
    cifar = load_scenario(
        ROOT / "scenarios" / "resnet18-cifar.yaml", ["data.name=cifar10", "data.root=/x"]
    )
    assert cifar.data.model_dump(mode="json") == {"name": "cifar10", "root": "/x"}
    # Only the earlier kind's own keys go: a typo set before the name is still named.
    with pytest.raises(ScenarioError, match="szie"):
        load_scenario(
            ROOT / "scenarios" / "resnet18-imagenet.yaml",
            ["data.root=/x", "data.szie=64", "data.name=imagefolder"],
        )
    # The same kind again keeps what the file says.
    same = load_scenario(ROOT / "scenarios" / "resnet18-cifar.yaml", ["data.name=synthetic-images"])
    assert same.data.num_samples == 50000


# ------------------------------------------------------------------ the CLI
@pytest.mark.parametrize(
    "content, fragment",
    [
        ("name: x\nmodel: {name: resnet18, colour: red}\n", "unknown key 'colour'"),
        (
            "name: x\nmodel: {name: resnet18}\ndata: {name: synthetic-images}\ntrain: {steps: lots}\n",
            "train.steps: Input should be a valid integer",
        ),
        (
            "model: {name: resnet18}\ndata: {name: synthetic-images}\noptimizations: {toy_probe: {depth: 0}}\n",
            "depth=0 is out of range",
        ),
        ("model: [\n", "not valid YAML"),
        ("model: {name: alexnet}\ndata: {name: synthetic-images}\n", "unknown model 'alexnet'"),
    ],
)
def test_cli_reports_bad_scenarios_with_exit_code_2(tmp_path, content, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    for command in ("check", "run"):
        result = cli_here(command, path)
        assert result.returncode == 2, result.stderr
        assert fragment in result.stderr
        assert "Traceback" not in result.stderr


def test_cli_missing_scenario_and_missing_data_folder(tmp_path):
    result = cli_here("run", tmp_path / "nope.yaml")
    assert result.returncode == 2 and "scenario file not found" in result.stderr
    scenario = tmp_path / "cifar.yaml"
    scenario.write_text(
        f"model: {{name: resnet18}}\ndata: {{name: cifar10, root: {tmp_path / 'no-cifar'}}}\n"
    )
    result = cli_here("run", scenario)
    assert result.returncode == 2
    assert "CIFAR-10 folder not found at" in result.stderr and "never downloads" in result.stderr


def test_cli_check_and_list(tiny_scenario):
    result = cli_here("check", tiny_scenario(), "--set", "optimizations.toy_probe.intensity=0.5")
    assert result.returncode == 0, result.stderr
    assert "scenario tiny: ok" in result.stdout and "optimizations.toy_probe" in result.stdout
    result = cli_here("list", "--json")
    assert result.returncode == 0, result.stderr
    import json

    catalogue = json.loads(result.stdout)
    probe = next(o for o in catalogue["optimizations"] if o["name"] == "toy_probe")
    assert probe["intensity_mapping"]["1.0"]["depth"] == 16
    assert catalogue["scheduler_policies"] == ["free", "priority", "partition"]
    assert [k["name"] for k in catalogue["policy_knobs"]["partition"]][0] == "profile_steps"
    table = cli_here("list")
    assert "toy_probe" in table.stdout and "@0.5" in table.stdout


def test_scenario_files_exist_at_the_documented_paths():
    assert (Path(ROOT) / "scenarios" / "quickstart.yaml").is_file()


def test_check_shows_the_settings_as_they_will_run_in_80_columns(tiny_scenario):
    from rich.console import Console

    from overlapkit.cli import _describe_scenario

    path = tiny_scenario(
        TINY_SCENARIO.replace("world: {nprocs: 1}", "world: {nprocs: 2}")
        + "optimizations: {pipeline: {stages: 2, microbatches: 4}, checkpoint: {every: 2}}\n"
        + "tune: {trials: 7, search: {checkpoint: {every: [2, 8]}}}\n"
    )
    console = Console(width=80, record=True)
    console.print(_describe_scenario(load_scenario(path)))
    text = console.export_text()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines)
    # No null or None, and nothing a run measures (no result fields).
    assert "null" not in text and "None" not in text
    for result_field in ("stall_s_mean", "bytes_written", "bubble_fraction", "total_stages"):
        assert result_field not in text
    row = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in lines
        if line.count("│") == 3
    }
    assert row["microbatches"] == "4  (set)" and row["every"] == "2  (set)"
    assert row["dir"] == "checkpoints"
    # The tune section, with the space it searches.
    assert row["trials"] == "7"
    assert row["space: checkpoint.every"] == "2, 8"
    assert row["space: checkpoint.on"] == "yes, no"
    # Section names whole, not cut at 80 columns.
    assert "optimizations.checkpoint" in row and "optimizations.pipeline" in row


def test_check_of_a_scenario_without_optimizations_shows_what_tune_will_search(tiny_scenario):
    """`tune` searches every built-in optimization that applies when the scenario lists
    none; `check` said "nothing to search" there."""
    from rich.console import Console

    from overlapkit.cli import _describe_scenario

    console = Console(width=120, record=True)
    console.print(_describe_scenario(load_scenario(tiny_scenario())))
    text = console.export_text()
    assert "nothing to search" not in text
    assert "space: chosen" in text and "space: prefetch.intensity" in text
    assert "left out ddp_overlap" in text and "does nothing with one rank" in text


def test_check_shows_every_auto_as_auto_not_the_interval_it_replaces(tiny_scenario):
    from rich.console import Console

    from overlapkit.cli import _describe_scenario

    path = tiny_scenario(TINY_SCENARIO + "optimizations: {checkpoint: {every: auto}}\n")
    console = Console(width=120, record=True)
    console.print(_describe_scenario(load_scenario(path)))
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in console.export_text().splitlines()
        if line.count("│") == 3
    }
    assert rows["every"] == "auto  (set)" and rows["auto"] == "yes"


def test_optimizations_that_cannot_run_together_are_not_both_searched():
    """quickstart (2 ranks, no optimizations listed): tune searched pipeline beside
    ddp_overlap, and every trial with both was refused ('ddp_overlap needs at least 2
    replicas of each pipeline stage'): the study's trials wasted."""
    two = load_scenario(ROOT / "scenarios" / "quickstart.yaml")
    chosen, left_out = two.applicable_optimizations()
    assert "ddp_overlap" in chosen and "pipeline" not in chosen
    assert "cannot run beside" in left_out["pipeline"] and "2 replicas" in left_out["pipeline"]
    four = load_scenario(ROOT / "scenarios" / "quickstart.yaml", ["world.nprocs=4"])
    assert {"ddp_overlap", "pipeline"} <= set(four.applicable_optimizations()[0])


def test_list_at_80_columns_shows_every_knob_name_whole():
    """As nine columns, rich cut the names at 80 columns ("max_ov…", "bucke…")."""
    from rich.console import Console

    from overlapkit.cli import _catalogue, _print_catalogue

    catalogue = _catalogue()
    console = Console(width=80, record=True)
    _print_catalogue(console, catalogue)
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    cells = {c.strip() for line in text.splitlines() for c in line.split("│")}
    for entry in catalogue["optimizations"]:
        for knob in entry["knobs"]:
            assert knob["name"] in cells, knob["name"]
    # What each intensity sets: one row per level, the knobs it maps as columns.
    buckets = next(line for line in text.splitlines() if line.startswith("│ @0.5 "))
    assert "…" not in text and buckets


def test_check_shows_a_search_of_the_intensity_not_a_blank():
    """[intensity] read as rich markup: `search.ddp_overlap` showed an empty value."""
    from rich.console import Console

    from overlapkit.cli import _describe_scenario

    console = Console(width=80, record=True)
    console.print(_describe_scenario(load_scenario(Path(ROOT) / "scenarios/tune-contend.yaml")))
    line = next(x for x in console.export_text().splitlines() if "search.ddp_overlap" in x)
    assert "[intensity]" in line

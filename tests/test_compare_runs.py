"""overlapkit compare RUN_DIR...: two real runs of the tiny scenario side by side."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_SCENARIO, cli_here, run_cli


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    scenario = folder / "tiny.yaml"
    scenario.write_text(TINY_SCENARIO)
    plain, checkpointed = folder / "plain", folder / "checkpointed"
    assert run_cli("run", scenario, "--out", plain, "--quiet").returncode == 0
    result = run_cli(
        "run", scenario, "--out", checkpointed, "--quiet",
        "--set", "optimizations.checkpoint.every=2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return plain, checkpointed


def test_two_runs_side_by_side_with_phases_and_key_figures(two_runs, tmp_path):
    plain, checkpointed = two_runs
    result = cli_here("compare", plain, checkpointed, "--out", tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    first, second = document["runs"]
    summaries = [json.loads((f / "summary.json").read_text()) for f in two_runs]
    assert (first["label"], second["label"]) == ("plain", "checkpointed")
    assert first["samples_per_s"] == summaries[0]["samples_per_s"]
    assert second["vs_first"] == pytest.approx(
        summaries[1]["samples_per_s"] / summaries[0]["samples_per_s"]
    )
    assert second["phases_ms"]["ckpt_stall"] == pytest.approx(
        summaries[1]["phases_s"]["ckpt_stall"] * 1e3
    )
    # The checkpoint's key figures, as it declares them; absent from the plain run.
    figures = second["optimizations"]["checkpoint"]
    assert figures["checkpoints"] == summaries[1]["optimizations"]["checkpoint"]["checkpoints"] > 0
    assert "checkpoint" not in first["optimizations"]
    assert (tmp_path / "phases.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "compare.json").read_text()) == document
    # The table: every phase and the key figures, "off" where a run lacks the optimization.
    table = cli_here("compare", plain, checkpointed, "--out", tmp_path).stdout
    for text in ("samples/s", "ckpt_stall ms", "parallel efficiency", "checkpoint: checkpoints"):
        assert text in table
    assert "off" in table.split("checkpoint: checkpoints")[1].splitlines()[0]


def test_a_folder_without_a_finished_run_is_a_clear_error(two_runs, tmp_path):
    result = cli_here("compare", two_runs[0], tmp_path)
    assert result.returncode == 2
    assert f"{tmp_path}: no summary.json" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_file_or_a_summary_of_something_else_is_named(two_runs, tmp_path):
    (tmp_path / "afile").write_text("")
    other = tmp_path / "other"
    other.mkdir()
    (other / "summary.json").write_text('{"accuracy": 0.9}')
    nulls = tmp_path / "nulls"  # the keys, without figures in them (an internal error)
    nulls.mkdir()
    (nulls / "summary.json").write_text('{"samples_per_s": 10.0, "step_time_s": {"p50": null}}')
    for target, said in (
        (tmp_path / "afile", "a file; name a run folder"),
        (other, "not an overlapkit run summary (it lacks samples_per_s, step_time_s)"),
        (nulls, "not an overlapkit run summary (step_time_s.p50 is null, not a number)"),
    ):
        result = cli_here("compare", two_runs[0], target)
        assert result.returncode == 2 and said in result.stderr, result.stderr
        assert "internal error" not in result.stderr


def test_an_out_that_cannot_be_a_folder_names_out(two_runs, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    for out, said in ((taken, "--out"), (taken / "below", "--out")):
        result = cli_here("compare", *two_runs, "--out", out)
        assert result.returncode == 2 and said in result.stderr, result.stderr
        assert "internal error" not in result.stderr
    assert taken.read_text() == "mine"


def test_a_summary_without_phases_shows_them_as_not_measured(two_runs, tmp_path):
    """Every phase of such a run read 0.00 ms: measured as nothing, not unmeasured."""
    import shutil

    plain, checkpointed = two_runs
    bare = tmp_path / "bare"
    shutil.copytree(plain, bare)
    summary = json.loads((bare / "summary.json").read_text())
    del summary["phases_s"]
    (bare / "summary.json").write_text(json.dumps(summary))
    result = cli_here("compare", checkpointed, bare, "--out", tmp_path / "c", "--json")
    assert result.returncode == 0, result.stderr
    first, second = json.loads(result.stdout)["runs"]
    assert first["phases_ms"]["ckpt_stall"] > 0 and first["phases_ms"]["forward"] > 0
    assert set(second["phases_ms"].values()) == {None}
    table = cli_here("compare", checkpointed, bare, "--out", tmp_path / "d").stdout
    assert "n/a" in table.split("ckpt_stall ms")[1].splitlines()[0]


def test_at_80_columns_the_row_names_stay_whole_and_the_run_names_fold(two_runs, tmp_path):
    """Three runs in folders named as `run` names them: rich narrowed every column
    alike, cutting the row names mid-word ("communicat / ion efficiency")."""
    import shutil

    from rich.console import Console

    from overlapkit.compare_runs import compare_document, comparison_table

    folders = []
    for i, run in enumerate((*two_runs, two_runs[0])):
        folders.append(tmp_path / f"quickstart-20250611-10150{i}")
        shutil.copytree(run, folders[-1])
    console = Console(width=80, record=True)
    console.print(comparison_table(compare_document(folders), console.width))
    lines = console.export_text().splitlines()
    for name in ("communication efficiency", "checkpoint: checkpoints", "comm_exposed ms"):
        assert any(name in line for line in lines), name


def test_runs_of_one_name_are_two_columns_and_two_bars(tmp_path, monkeypatch):
    """x/r/a and y/r/a were both labelled r/a, and phases.png drew their bars as one."""
    from overlapkit import compare_runs

    folders = [tmp_path / "x" / "r" / "a", tmp_path / "y" / "r" / "a"]
    for rate, folder in zip((100, 50), folders, strict=True):
        folder.mkdir(parents=True)
        summary = {"samples_per_s": rate, "step_time_s": {"p50": 0.01}, "phases_s": {"f": 0.01}}
        (folder / "summary.json").write_text(json.dumps(summary))
    document = compare_runs.compare_document(folders)
    assert [r["label"] for r in document["runs"]] == [str(f) for f in folders]
    drawn = []
    monkeypatch.setattr(compare_runs, "save_figure", lambda fig, path: drawn.append(fig))
    compare_runs.phases_plot(document, tmp_path / "phases.png")
    bars = drawn[0].axes[0].patches
    assert len({bar.get_x() for bar in bars}) == 2


def test_a_run_resumed_near_its_end_shows_the_few_steps_it_measured(two_runs, tmp_path):
    """A run resumed at step 112 of 117 measured 4 steps (70 samples/s against 665 for
    a fresh run), shown beside the others with nothing to say so."""
    import shutil

    from rich.console import Console

    from overlapkit.compare_runs import compare_document, comparison_table

    resumed = tmp_path / "resumed"
    shutil.copytree(two_runs[1], resumed)
    summary = json.loads((resumed / "summary.json").read_text())
    summary["steps"] = 2
    summary["optimizations"]["checkpoint"]["resumed_from_step"] = 4
    (resumed / "summary.json").write_text(json.dumps(summary))
    console = Console(width=120, record=True)
    console.print(comparison_table(compare_document([two_runs[0], resumed]), console.width))
    (line,) = [x for x in console.export_text().splitlines() if "steps measured" in x]
    cells = [cell.strip() for cell in line.split("│")[1:-1]]
    assert cells == ["steps measured", "6", "2 (resumed at 4)"], line

"""`overlapkit run`: folders named by time (runs started in the same second never share
one) and what it prints (stdout holds only the JSON document under --json)."""

import json
import multiprocessing
from pathlib import Path

from overlapkit.folders import claim

ROUNDS = 40


def _claim(parent: Path, start, created) -> None:
    for k in range(ROUNDS):
        start.wait()  # every process asks for the same name at once
        created.put(str(claim(parent / f"x-{k}")))


def test_processes_claiming_one_name_at_once_each_get_their_own_folder(tmp_path):
    context = multiprocessing.get_context("fork")
    start, created = context.Barrier(6), context.Queue()
    processes = [
        context.Process(target=_claim, args=(tmp_path / "runs", start, created)) for _ in range(6)
    ]
    for process in processes:
        process.start()
    folders = [created.get(timeout=60) for _ in range(6 * ROUNDS)]
    for process in processes:
        process.join(timeout=60)
    expected = [
        f"x-{k}{suffix}" for k in range(ROUNDS) for suffix in ["", "-2", "-3", "-4", "-5", "-6"]
    ]
    assert sorted(Path(f).name for f in folders) == sorted(expected)  # none given twice


def test_two_runs_started_in_the_same_second_write_separate_folders(
    tiny_scenario, tmp_path, monkeypatch, capsys
):
    """Run folders are named by the second: a second run that second got the first
    one's folder and resumed from its final checkpoint (no step of its own)."""
    from overlapkit.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda *_: "20261123-120000")
    command = [
        "run", str(tiny_scenario()), "--quiet",
        "--set", "optimizations.checkpoint={every: 2}",
        "--set", "train.steps=4",
        "--set", "train.warmup_steps=0",
    ]  # fmt: skip
    for _ in range(2):
        assert main(command) == 0, capsys.readouterr().err
    folders = sorted(p.parent for p in (tmp_path / "runs").glob("*/summary.json"))
    assert [f.name for f in folders] == ["tiny-20261123-120000", "tiny-20261123-120000-2"]
    for folder in folders:
        assert len((folder / "steps.jsonl").read_text().splitlines()) == 4
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["optimizations"]["checkpoint"]["resumed_from_step"] is None
    assert "runs/tiny-20261123-120000-2" in capsys.readouterr().err


def test_run_json_stdout_holds_only_the_document_whatever_else_writes_there(
    tiny_scenario, tmp_path, monkeypatch, capfd
):
    """gloo (torch 2.8, 2.9) prints "[Gloo] Rank 0 is connected to 1 peer ranks" from C++
    in every rank: on stdout, it broke `run --json`'s document. Here the run's own
    process and a child it starts write such lines to file descriptor 1."""
    import os
    import subprocess

    import overlapkit.run
    from overlapkit.cli import main

    def run_scenario(scenario, run_dir, **_):
        os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks.\n")
        subprocess.run(["sh", "-c", "echo '[Gloo] Rank 1 is connected to 1 peer ranks.'"])
        return {"samples_per_s": 1.0}

    monkeypatch.setattr(overlapkit.run, "run_scenario", run_scenario)
    assert main(["run", str(tiny_scenario()), "--json", "--out", str(tmp_path / "r")]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out) == {"samples_per_s": 1.0}
    assert "Rank 0 is connected" in err and "Rank 1 is connected" in err


def test_deterministic_runs_repeat_their_losses_exactly(tiny_scenario, tmp_path):
    """``train.deterministic`` on a CPU: torch's deterministic algorithms, no note (the
    GPU's warn-only mode has one), and two runs give the same step losses."""
    from conftest import run_cli, step_losses

    runs = []
    for name in ("a", "b"):
        done = run_cli(
            "run", tiny_scenario(), "--quiet", "--out", tmp_path / name,
            "--set", "train.deterministic=true",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert not any("deterministic" in note for note in summary.get("notes", []))
        runs.append(step_losses(tmp_path / name))
    assert runs[0] == runs[1] and len(runs[0]) == 8  # warm-up steps included


def test_a_folder_that_is_not_a_run_is_not_written_into(tiny_scenario, tmp_path):
    """``--out .`` from the user's project folder wrote the resolved scenario over
    their own (comments gone), and a folder of other files got a run's files mixed in."""
    from conftest import run_cli

    scenario = tiny_scenario()  # tmp_path/scenario.yaml, the user's own
    text = scenario.read_text()
    over = run_cli("run", scenario, "--out", tmp_path)
    assert over.returncode == 2 and "over " in over.stderr and "itself" in over.stderr
    assert scenario.read_text() == text
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    mixed = run_cli("run", scenario, "--out", mine)
    assert mixed.returncode == 2 and "holds notes.txt, and no earlier run" in mixed.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert "Traceback" not in over.stderr + mixed.stderr
    # Accepted: a folder of dotfiles only; a run folder run again from its own resolved
    # scenario; a machine's folder of checkpoints only (another machine holds the rest).
    (tmp_path / "dots").mkdir()
    (tmp_path / "dots" / ".gitkeep").write_text("")
    assert run_cli("run", scenario, "--out", tmp_path / "dots", "--quiet").returncode == 0
    again = tmp_path / "dots" / "scenario.yaml"
    assert run_cli("run", again, "--out", tmp_path / "dots", "--quiet", "--fresh").returncode == 0
    (tmp_path / "machine1" / "checkpoints").mkdir(parents=True)
    assert run_cli("run", scenario, "--out", tmp_path / "machine1", "--quiet").returncode == 0


def test_resume_continues_the_newest_run_with_checkpoints(tiny_scenario, tmp_path):
    """A run of the same name without checkpoints, made since, is not the one resumed
    (--resume picked it, then told the user to start over there with --fresh)."""
    from conftest import TINY_SCENARIO, run_cli

    checkpointed = tiny_scenario(
        TINY_SCENARIO + "optimizations: {checkpoint: {every: 2}}\n", "c.yaml"
    )
    plain = tiny_scenario(name="t.yaml")
    quick = ["--set", "train.steps=2", "--quiet"]
    assert run_cli("run", checkpointed, *quick, cwd=tmp_path).returncode == 0
    assert run_cli("run", plain, *quick, cwd=tmp_path).returncode == 0
    runs = sorted((tmp_path / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    # A run stopped before its first checkpoint leaves its held, empty checkpoints/.
    stopped = tmp_path / "runs" / f"{runs[0].name.rsplit('-', 2)[0]}-20991231-235959"
    (stopped / "checkpoints").mkdir(parents=True)
    (stopped / "checkpoints" / ".lock").write_text("4242\n")
    (stopped / "scenario.yaml").write_text((runs[0] / "scenario.yaml").read_text())
    resumed = run_cli("run", checkpointed, "--resume", "--set", "train.steps=4", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"run folder {runs[0].relative_to(tmp_path)}" in resumed.stderr
    assert "resum" in resumed.stderr


def test_a_second_run_into_a_folder_in_use_is_refused_and_a_killed_run_leaves_no_lock(
    tiny_scenario, tmp_path
):
    """Two runs at once in one --out both trained there, and the second died with "No such
    file or directory: .../.shared.ckpt.tmp-N". The first's launcher holds the folder (an
    OS lock): the second is refused at once, naming it and its pid, writing nothing; a
    SIGKILLed run leaves no lock behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT, run_cli

    scenario = tiny_scenario()
    out = tmp_path / "run"
    command = [sys.executable, "-m", "overlapkit", "run", str(scenario), "--out", str(out)]
    sets = ["--quiet", "--set", "optimizations.checkpoint.every=2", "--set"]
    first = subprocess.Popen(
        [*command, *sets, "train.steps=100000"],
        cwd=ROOT,
        start_new_session=True,  # its group: the launcher and its rank
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "manifest.json").exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        scenario_yaml = (out / "scenario.yaml").read_text()
        second = run_cli(*command[3:], *sets, "train.steps=99999", timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"{out} is in use by another run (pid {first.pid})" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1  # one line, no traceback
        assert (out / "scenario.yaml").read_text() == scenario_yaml  # not its own
        assert not (out / "error.txt").exists()
        # Its checkpoint folder is held too: another folder naming it is refused.
        other = run_cli(
            "run", scenario, "--out", tmp_path / "other", *sets[:-1],
            "--set", f"optimizations.checkpoint.dir={out / 'checkpoints'}", timeout=120,
        )  # fmt: skip
        assert other.returncode == 2, other.stderr
        assert f"{out / 'checkpoints'} is in use by another run (pid {first.pid})" in other.stderr
        assert not (tmp_path / "other").exists()
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    newest = json.loads((out / "checkpoints" / "manifest.json").read_text())["checkpoints"][-1]
    resumed = run_cli(*command[3:], *sets, f"train.steps={newest['step'] + 2}", timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {newest['step']}" in resumed.stderr


def test_a_run_into_a_shared_checkpoint_folder_in_use_is_refused(tiny_scenario, tmp_path):
    """An absolute checkpoint.dir may be shared by several run folders: a second run in
    another folder (named or new) checkpointed into the folder a first run was writing.
    The launcher holds it as it holds its run folder, and keeps holding it when --fresh
    moves the old checkpoints aside."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT, run_cli

    shared = tmp_path / "shared"
    scenario = tiny_scenario()
    sets = ["--quiet", "--set", f"optimizations.checkpoint={{every: 2, dir: {shared}}}"]
    done = run_cli("run", scenario, "--out", tmp_path / "a", *sets, "--set", "train.steps=2")
    assert done.returncode == 0, done.stderr[-2000:]
    first = subprocess.Popen(
        [sys.executable, "-m", "overlapkit", "run", str(scenario), "--out", str(tmp_path / "a")]
        + [*sets, "--fresh", "--set", "train.steps=100000"],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (list(tmp_path.glob("shared.old-*")) and (shared / "manifest.json").exists()):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        for out in (["--out", tmp_path / "b"], []):  # another folder, named or new
            second = run_cli("run", scenario, *out, *sets, "--set", "train.steps=9", cwd=tmp_path)
            assert second.returncode == 2, second.stderr
            assert f"{shared} is in use by another run (pid {first.pid})" in second.stderr
            assert "set another checkpoint.dir" in second.stderr
            assert len(second.stderr.strip().splitlines()) == 1
            assert not (tmp_path / "b").exists() and not (tmp_path / "runs").exists()
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    (aside,) = tmp_path.glob("shared.old-*")
    assert (aside / "manifest.json").exists() and not (aside / ".lock").exists()
    newest = json.loads((shared / "manifest.json").read_text())["checkpoints"][-1]["step"]
    more = f"train.steps={newest + 2}"
    again = run_cli("run", scenario, "--out", tmp_path / "b", *sets, "--set", more)
    assert again.returncode == 0, again.stderr[-2000:]  # a killed run holds nothing
    assert f"resumed at step {newest}" in again.stderr


def test_the_summary_tables_read_at_80_columns(tiny_scenario, tmp_path):
    """The phases' title broke after "(mean" over the narrow table, and the settings
    showed stall_s_mean=0.018160840000443084 and bytes_written=44040192."""
    from rich.console import Console

    from conftest import run_cli
    from overlapkit.runtime.report import summary_tables

    done = run_cli(
        "run", tiny_scenario(), "--quiet", "--out", tmp_path / "r",
        "--set", "optimizations.checkpoint.every=2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    console = Console(record=True, width=80)
    for table in summary_tables(summary):
        console.print(table)
    text = console.export_text()
    assert "where each step's time went" in text and "ms per step" in text
    titled = [line.strip() for line in text.splitlines() if "time went" in line]
    assert titled == ["where each step's time went"]  # on one line of its own
    checkpoint = summary["optimizations"]["checkpoint"]
    stall, written = checkpoint["stall_s_mean"], checkpoint["bytes_written"]
    assert f"stall_s_mean={stall:.3g}" in text
    assert str(stall) == f"{stall:.3g}" or str(stall) not in text  # not all its digits
    mib = f"{written / 2**20:.1f} MiB" if written >= 2**20 else f"{written} B"
    assert f"bytes_written={mib}" in text


def test_checkpoint_at_intensity_0_runs_without_checkpoints(tiny_scenario, tmp_path):
    """The README's way to turn an optimization off was an internal error (StopIteration)
    when its section was checkpoint's."""
    from conftest import run_cli

    done = run_cli(
        "run", tiny_scenario(), "--out", tmp_path / "r", "--quiet",
        "--set", "optimizations.checkpoint.intensity=0", "--set", "train.steps=2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "r" / "checkpoints").exists()

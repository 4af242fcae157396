"""A user's mistake is a clear message and exit 2, never a traceback; in-process.

The property-based tests throw malformed scenario files (bytes that are not text,
other encodings, every key set to values of the wrong type or range, wrong
nesting) and malformed arguments at the CLI: each must end in exit 2 with a
message that names the key or argument."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from conftest import TINY_SCENARIO, run_cli
from overlapkit.cli import main

BASE = yaml.safe_load(textwrap.dedent(TINY_SCENARIO))
BASE["optimizations"] = {"checkpoint": {"intensity": 0.5}, "prefetch": {"intensity": 0.5}}
BASE["tune"] = {"trials": 2}


def cli(*argv: Any) -> tuple[int, str, str]:
    """Run the CLI here; (exit status, stdout, stderr). A traceback fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as done:  # argparse's usage errors
            code = done.code
    assert "Traceback" not in err.getvalue() + out.getvalue(), err.getvalue()
    return code, out.getvalue(), err.getvalue()


def paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested mapping (sections and leaves)."""
    found = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            found.append((*prefix, key))
            found += paths(value, (*prefix, key))
    return found


KEY_PATHS = paths(BASE) + [  # keys the tiny file leaves at their defaults
    ("train", "accumulate"),
    ("train", "precision"),
    ("train", "eval", "every"),
    ("train", "lr_schedule", "name"),
    ("world", "backend"),
    ("world", "device"),
    ("world", "threads"),
    ("world", "nodes"),
    ("scheduler", "policy"),
    ("optimizations", "checkpoint", "every"),
    ("optimizations", "prefetch", "depth"),
    ("optimizations", "ddp_overlap", "bucket_mb"),
    ("tune", "objective"),
    ("tune", "repeats"),
]

WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**12), max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(-3, 3), max_size=2),
)

# Hypothesis keeps its caches in ./.hypothesis: here in a temp folder, not the checkout.
set_hypothesis_home_dir(tempfile.mkdtemp(prefix="overlapkit-hypothesis-"))
FAST = settings(  # no example database: nothing is written into the checkout
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def set_path(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(tree.get(key), dict):
            tree[key] = {}
        tree = tree[key]
    tree[path[-1]] = value


def named(path: tuple, message: str) -> bool:
    """Whether ``message`` points at ``path``: its dotted form, or a section of it."""
    return any(".".join(map(str, path[:end])) in message for end in range(len(path), 0, -1))


def accepted_or_named(tmp_path: Path, data: dict, path: tuple) -> None:
    """``check`` on ``data`` passes, or exits 2 naming ``path`` (or a section of it)."""
    file = tmp_path / "scenario.yaml"
    file.write_text(yaml.safe_dump(data))
    code, _, err = cli("check", file)
    assert code in (0, 2), err
    if code == 2:
        assert named(path, err), err


@FAST
@given(path=st.sampled_from(KEY_PATHS), value=WRONG)
@example(path=("world", "nprocs"), value=33)  # more ranks than the data has batches for
def test_any_key_with_any_value_is_accepted_or_a_located_error(tmp_path, path, value):
    data = json.loads(json.dumps(BASE))
    set_path(data, path, value)
    accepted_or_named(tmp_path, data, path)


@FAST
@given(path=st.sampled_from(KEY_PATHS), section=st.sampled_from(["list", "scalar", "deeper"]))
def test_wrong_nesting_is_a_located_error(tmp_path, path, section):
    data = json.loads(json.dumps(BASE))
    node = data
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node.get(key), dict) else {}
    old = node.get(path[-1], 1)
    wrong = {"list": [old], "scalar": "x", "deeper": {"value": old}}[section]
    set_path(data, path, wrong)
    accepted_or_named(tmp_path, data, path)


@FAST
@given(content=st.binary(max_size=200))
def test_any_bytes_as_a_scenario_file_is_exit_2(tmp_path, content):
    file = tmp_path / "scenario.yaml"
    file.write_bytes(content)
    code, _, err = cli("check", file)
    assert code == 2 and "scenario.yaml" in err, err


@FAST
@given(content=st.binary(max_size=200))
def test_any_bytes_as_a_cluster_config_is_exit_2(tmp_path, content):
    file = tmp_path / "cluster.yaml"
    file.write_bytes(content)
    code, _, err = cli("cluster", "check", file)
    assert code == 2 and "cluster.yaml" in err, err


@FAST
@given(encoding=st.sampled_from(["utf-16", "utf-32", "latin-1", "cp1252"]))
def test_a_scenario_saved_in_another_encoding_is_exit_2(tmp_path, encoding):
    file = tmp_path / "scenario.yaml"
    file.write_bytes(("# caf\u00e9 r\u00e9sum\u00e9\n" + TINY_SCENARIO).encode(encoding))
    code, _, err = cli("check", file)
    assert code == 2 and "scenario.yaml" in err, err


NUMERIC = {
    "tune": ["--trials", "--workers", "--timeout", "--max-concurrent"],
    "report": ["--mtbf-hours", "--restart-s", "--job-hours"],
    "run": ["--node-rank"],
}
SOUND = {  # values of JUNK that are right for that argument
    "--restart-s": ("0", "1.5"),
    "--timeout": ("1.5",),
    "--mtbf-hours": ("1.5",),
    "--job-hours": ("1.5",),
    "--node-rank": ("0",),
}


def _a_number(text: str) -> bool:
    """What Python reads as a number ("1E0", "1_0", " 2 " too): not junk."""
    try:
        float(text)
    except ValueError:
        return False
    return True


JUNK = st.one_of(
    st.text(max_size=8).filter(lambda t: not _a_number(t)),
    st.integers(max_value=-1).map(str),
    st.sampled_from(["0", "-0.5", "nan", "inf", "1e999", "-inf", "1.5"]),
)


@FAST
@given(data=st.data())
def test_malformed_numeric_arguments_name_the_argument(tmp_path, data):
    command = data.draw(st.sampled_from(sorted(NUMERIC)))
    flag = data.draw(st.sampled_from(NUMERIC[command]))
    value = data.draw(JUNK)
    if value in SOUND.get(flag, ()):
        value = "-1"
    target = tmp_path / "missing" if command == "report" else tmp_path / "scenario.yaml"
    code, _, err = cli(command, target, f"{flag}={value}")
    assert code == 2 and flag in err, err


def test_a_numeric_argument_says_what_kind_of_number_it_takes(tmp_path):
    """It said "'abc' is not a int" (Python's type names)."""
    for command, flag, value, said in (
        ("tune", "--max-concurrent", "abc", "'abc' is not a whole number"),
        ("tune", "--trials", "1.5", "'1.5' is not a whole number"),
        ("tune", "--timeout", "abc", "'abc' is not a number"),
    ):
        code, _, err = cli(command, tmp_path / "scenario.yaml", flag, value)
        assert code == 2 and f"argument {flag}: {said}" in err, err


@FAST
@given(override=st.text(max_size=20))
@example(override="0.0=")  # a key only --set made, with a parent it made too (found by CI)
@example(override="data.shape=[3,16]")  # the file had a data.shape.2 that --set replaced
def test_any_set_argument_is_accepted_or_names_itself(tiny_scenario, override):
    code, _, err = cli("check", tiny_scenario(), "--set", override)
    assert code in (0, 2), err
    if code == 2:
        assert "--set" in err, err


# ---------------------------------------------------------------- each mistake seen
def test_tune_arguments_and_storages_that_cannot_work_leave_nothing_behind(tiny_scenario, tmp_path):
    scenario, out = tiny_scenario(), tmp_path / "tune"
    for storage, said in (
        ("notaurl", "is not a storage URL"),
        (f"sqlite:///{tmp_path}/no/such/study.db", "does not exist"),
        ("postgresql+psycopg2://user:pw@127.0.0.1:1/db", "cannot open it"),
        (f"journal:{tmp_path}/no/such/journal.log", "does not exist"),
        ("sqlite://", "in-memory database"),  # one connection's: every trial's lost
        (f"sqlite:///{tmp_path}", "is a folder"),
        (f"journal:{tmp_path}", "is a folder"),
        ("postgresql://user:pw@127.0.0.1:1/db", "postgresql+psycopg2://"),  # psycopg 3 absent
    ):
        code, _, err = cli("tune", scenario, "--storage", storage, "--out", out)
        assert code == 2 and "--storage" in err and said in err, err
    code, _, err = cli("tune", scenario, "--trials", 0, "--out", out)
    assert code == 2 and "--trials" in err
    assert not out.exists()


def test_report_of_a_storage_file_that_does_not_exist_makes_none(tmp_path):
    for url in (f"sqlite:///{tmp_path}/nosuch.db", f"journal:{tmp_path}/nosuch.log"):
        code, _, err = cli("report", url)
        assert code == 2 and "there is no such" in err, err
    assert list(tmp_path.iterdir()) == []


def test_report_of_a_broken_tune_folder_is_one_line_and_writes_nothing(tmp_path):
    """A tune file that is not JSON, or lacks its keys, was an internal error; one whose
    database is gone got an empty database made there, and blamed a --study never given."""
    import json

    for text in ("{oops", "{}"):
        (tmp_path / "tune.json").write_text(text)
        code, _, err = cli("report", tmp_path)
        assert code == 2 and "is not a tune file overlapkit can read" in err, err
    db = tmp_path / "study.db"
    (tmp_path / "tune.json").write_text(
        json.dumps({"storage": f"sqlite:///{db}", "study": "gone", "scenario": {}, "tune": {}})
    )
    code, _, err = cli("report", tmp_path)
    assert code == 2 and "there is no such" in err and "--study" not in err, err
    assert not db.exists()
    optuna.create_study(study_name="real", storage=f"sqlite:///{db}")
    code, _, err = cli("report", tmp_path)
    assert code == 2 and "the study 'gone': no such study" in err and "real" in err, err


def test_report_of_a_study_the_storage_lacks_names_those_it_has(tmp_path):
    url = f"sqlite:///{tmp_path}/study.db"
    optuna.create_study(study_name="real", storage=url)
    code, _, err = cli("report", url, "--study", "nosuch")
    assert code == 2 and "nosuch" in err and "real" in err, err


def test_run_out_naming_a_file_is_exit_2_and_the_file_is_untouched(tiny_scenario, tmp_path):
    file = tmp_path / "taken"
    file.write_text("mine")
    code, _, err = cli("run", tiny_scenario(), "--out", file)
    assert code == 2 and "--out" in err and file.read_text() == "mine"


def test_the_help_line_names_every_command():
    from overlapkit.cli import _parser

    code, out, _ = cli("--help")
    line = next(line for line in out.splitlines() if line.startswith("overlapkit run |"))
    commands = _parser()._subparsers._group_actions[0].choices  # export was left out
    assert code == 0 and all(f" {name} " in f"{line[:-1]} " for name in commands), line


def test_files_export_and_compare_cannot_read_are_one_line(tmp_path):
    """A manifest or a summary that is not UTF-8 was an internal error; a tune folder
    was 'not a run folder', not what to compare instead."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "manifest.json").write_bytes(b"\xff\xfe{")
    code, _, err = cli("export", tmp_path / "checkpoints", "--to", tmp_path / "m.pt")
    assert code == 2 and "manifest.json is damaged (UnicodeDecodeError" in err, err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_bytes(b"\xff{")
    code, _, err = cli("compare", tmp_path / "run", "--out", tmp_path / "cmp")
    assert code == 2 and "summary.json: not valid JSON" in err, err
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "tune.json").write_text("{}")
    code, _, err = cli("compare", tmp_path / "tune", "--out", tmp_path / "cmp")
    assert code == 2 and "a tune folder, not a run's" in err and "report --compare" in err
    assert not (tmp_path / "m.pt").exists() and not (tmp_path / "cmp").exists()


def test_check_refuses_what_would_fail_inside_a_rank(tiny_scenario):
    scenario = tiny_scenario()
    code, _, err = cli(
        "check", scenario, "--set", "optimizations.pipeline.intensity=1",
        "--set", "world.nprocs=2", "--set", "train.accumulate=2",
    )  # fmt: skip
    assert code == 2 and "train.accumulate is 2" in err, err
    cores = len(os.sched_getaffinity(0))
    code, _, err = cli("check", scenario, "--set", f"world.nprocs={cores + 1}")
    assert code == 2 and f"{cores + 1} CPU ranks" in err and f"{cores} cores" in err, err


def test_too_many_ranks_for_the_cores_is_blamed_on_the_ranks_not_the_data(tiny_scenario):
    code, _, err = cli("check", tiny_scenario(), "--set", "world.nprocs=100000")
    assert code == 2 and "100000 CPU ranks" in err and "num_samples" not in err, err


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_any_rank_starts(tiny_scenario, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    scenario = tiny_scenario()
    code, _, err = cli("check", scenario, "--set", f"optimizations.checkpoint.dir={taken}/sub")
    assert code == 2 and f"{taken} is a file" in err, err
    # A relative one is found once the run folder is known, before any rank starts.
    out = tmp_path / "run"
    out.mkdir()
    (out / "taken").write_text("mine")
    (out / "scenario.yaml").write_text(scenario.read_text())  # an earlier run's folder
    code, _, err = cli("run", scenario, "--out", out, "--set", "optimizations.checkpoint.dir=taken")
    assert code == 2 and "is a file; name a folder" in err, err
    assert taken.read_text() == "mine" and (out / "taken").read_text() == "mine"


def test_a_file_in_the_way_of_the_run_folder_is_named_as_out_and_dotdot_is_resolved(
    tiny_scenario, tmp_path
):
    """``--out afile/sub`` was blamed on checkpoint.dir; ``dir: ../afile`` passed the
    check (``run/..`` does not exist before the run folder) and failed with exit 1 after
    the run folder was made."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    scenario = tiny_scenario(TINY_SCENARIO + "optimizations: {checkpoint: {every: 2}}\n")
    code, _, err = cli("run", scenario, "--out", afile / "sub", "--quiet")
    assert code == 2 and f"--out {afile / 'sub'}: {afile} is a file" in err, err
    assert "checkpoint.dir" not in err
    out = tmp_path / "run"
    code, _, err = cli(
        "run", scenario, "--out", out, "--quiet", "--set", "optimizations.checkpoint.dir=../afile"
    )
    assert code == 2 and f"{afile} is a file; name a folder" in err, err
    assert not out.exists() and afile.read_text() == "mine"


def test_a_checkpoint_dir_that_is_or_holds_the_run_folder_is_refused(tiny_scenario, tmp_path):
    """``dir: .`` (or a folder above the run folder): a --fresh start moved the run's
    own scenario.yaml aside with the old checkpoints (or the whole live run folder)."""
    out = tmp_path / "exp" / "run"
    for folder, said in ((".", "is the run folder"), (str(tmp_path / "exp"), "holds it")):
        code, _, err = cli(
            "run", tiny_scenario(), "--out", out, "--quiet",
            "--set", f"optimizations.checkpoint={{every: 2, dir: {folder}}}",
        )  # fmt: skip
        assert code == 2 and f"checkpoint.dir {folder} (" in err and said in err, err
        assert not out.exists()


def test_the_start_over_flags_name_the_run_folder_unless_the_checkpoints_are_elsewhere():
    """A relative checkpoint.dir outside the run folder (``../shared``) is found from the
    run folder: plain --fresh (a new folder) would start over in another one."""
    from overlapkit.optimizations.checkpoint.store import fresh_flags

    run = Path("/data/runs/r1")
    assert fresh_flags(run, "checkpoints") == f"--out {run} --fresh"
    assert fresh_flags(run, "../shared") == f"--out {run} --fresh"
    assert fresh_flags(run, "/data/shared") == "--fresh"
    assert fresh_flags(run, "/data/runs/r1/ckpt") == f"--out {run} --fresh"


def test_a_checkpoint_dir_of_its_own_under_ray_is_refused(tiny_scenario):
    """Under --ray the driver mirrors each machine's run-folder checkpoints/ and sends
    them back to resume: another folder would be neither (a failed run lost them)."""
    code, _, err = cli(
        "run", tiny_scenario(), "--ray", "127.0.0.1:1",
        "--set", "optimizations.checkpoint.dir=ckpt",
    )  # fmt: skip
    assert code == 2 and "checkpoint.dir is 'ckpt'" in err and "leave checkpoint.dir unset" in err


def test_an_internal_error_is_one_line_and_its_traceback_goes_to_a_file(tiny_scenario, monkeypatch):
    import overlapkit.cli as cli_module

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli_module, "_describe_scenario", broken)
    code, _, err = cli("check", tiny_scenario())
    assert code == 1 and "internal error" in err and "ZeroDivisionError: a bug" in err
    saved = Path(err.rsplit("the traceback is in ", 1)[1].strip())
    assert "Traceback" in saved.read_text() and "broken" in saved.read_text()
    saved.unlink()


def test_tune_without_optimizations_searches_those_that_apply(tiny_scenario, monkeypatch):
    from overlapkit.tuning import commands

    searched = {}

    def stop_before_trials(job, **_kwargs):
        searched.update(job.base["optimizations"])
        raise commands.TuneError("stopped before the first trial")

    monkeypatch.setattr(commands, "tune", stop_before_trials)
    text = TINY_SCENARIO.replace("world: {nprocs: 1}", "world: {nprocs: 1, device: cpu}")
    code, _, err = cli("tune", tiny_scenario(text), "--out", tiny_scenario().parent / "t")
    assert code == 2 and "stopped before the first trial" in err
    # One rank: ddp_overlap does nothing and pipeline needs two; the others are searched.
    assert set(searched) == {"checkpoint", "prefetch"}
    assert "left out ddp_overlap: does nothing with one rank" in err
    assert "left out pipeline: pipeline needs at least 2 ranks" in err


def image_folder(root: Path, classes: str = "abc", bad: bool = False) -> Path:
    import numpy as np
    from PIL import Image

    for name in classes:
        (root / "train" / name).mkdir(parents=True)
        for i in range(4):
            pixels = (np.random.default_rng(i).random((40, 40, 3)) * 255).astype("uint8")
            Image.fromarray(pixels).save(root / "train" / name / f"{i}.jpg")
    if bad:
        (root / "train" / classes[0] / "zz-bad.jpg").write_text("not an image")
    return root


def test_data_that_cannot_feed_the_model_is_refused_before_any_rank_starts(tiny_scenario, tmp_path):
    scenario = tiny_scenario()
    images = image_folder(tmp_path / "images")
    folder = f"data={{name: imagefolder, root: {images}, size: 32}}"
    alone = image_folder(tmp_path / "one-class", classes="a")
    (tmp_path / "afile").write_text("")
    for overrides, said in (
        (["data.num_samples=4"], "data.num_samples is 4, fewer than one step's batch (8"),
        ([folder, f"data.root={alone}"], "has 1 class folder(s): a classifier needs at least 2"),
        (["optimizations.checkpoint.every=often"], "every must be a number of steps or auto"),
        (["train.optimizer.name=sgd:x"], "name=sgd:x: train.optimizer.name"),  # no emoji
        (["data.shape=[1,16,16]"], "has 1 channel(s); model resnet18 reads 3"),
        (["data.shape=[3,0,0]"], "every side must be at least 1"),
        ([folder], f"model.num_classes is 4 but {images} has 3 class folders"),
        ([folder, f"data.root={tmp_path / 'afile'}"], "is a file, not an image folder"),
    ):
        sets = [word for override in overrides for word in ("--set", override)]
        code, _, err = cli("check", scenario, *sets)
        assert code == 2 and said in err, (overrides, err)
        assert "internal error" not in err


@pytest.mark.slow
def test_unreadable_data_files_are_named(tiny_scenario, tmp_path):
    images = image_folder(tmp_path / "images", "ab", bad=True)
    run = ["run", tiny_scenario(), "--quiet", "--set", "model.num_classes=2"]
    folder = f"data={{name: imagefolder, root: {images}, size: 32}}"
    code, _, err = cli(
        *run, "--out", tmp_path / "r1", "--set", folder, "--set", "train.batch_size=9"
    )
    assert code == 2 and f"cannot read the image {images}/train/a/zz-bad.jpg" in err, err
    # Found by one rank of two once they run: the same line, naming the rank, no traceback.
    two = run_cli(
        *run, "--out", tmp_path / "r3", "--set", folder,
        "--set", "train.batch_size=4", "--set", "world.nprocs=2",
    )  # fmt: skip
    assert two.returncode == 2 and "Traceback" not in two.stderr, two.stderr
    assert f"cannot read the image {images}/train/a/zz-bad.jpg" in two.stderr, two.stderr
    assert "error: rank " in two.stderr, two.stderr
    cifar = tmp_path / "cifar" / "cifar-10-batches-py"
    cifar.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (cifar / name).write_text("junk")
    code, _, err = cli(
        *run, "--out", tmp_path / "r2", "--set", f"data={{name: cifar10, root: {cifar.parent}}}",
        "--set", "model.num_classes=10",
    )  # fmt: skip
    assert code == 2 and f"{cifar}/data_batch_1 is not a CIFAR-10 batch file" in err, err


def test_folders_it_cannot_make_are_named_not_internal_errors(tiny_scenario, tmp_path):
    scenario = tiny_scenario()
    blocker = tmp_path / "afile"
    blocker.write_text("mine")
    for argv, said in (
        (["run", scenario, "--out", blocker / "sub"], f"--out {blocker / 'sub'}: {blocker} is a"),
        (["tune", scenario, "--out", blocker / "sub"], f"{blocker / 'sub'}: Not a directory"),
        (["run", scenario, "--tensorboard", blocker], "is a file; name a folder"),
        (
            ["run", scenario, "--set", "world.nodes=2", "--node-rank", 0, "--master", "h:99999"],
            "a port 1-65535",
        ),
    ):
        code, _, err = cli(*argv)
        assert code == 2 and said in err and "internal error" not in err, (argv, err)
    assert blocker.read_text() == "mine"


@pytest.mark.slow
def test_a_plugin_that_cannot_load_or_takes_a_builtin_name_is_named(tmp_path):
    (tmp_path / "clash.py").write_text(
        "from overlapkit import Optimization, register_optimization\n\n"
        "@register_optimization\nclass Mine(Optimization):\n    name = 'checkpoint'\n"
    )
    for plugins, said in (
        ("nosuchmod", "the plugin module 'nosuchmod' (OVERLAPKIT_PLUGINS) cannot be loaded"),
        ("clash", "clash.Mine takes the name 'checkpoint' of overlapkit.optimizations"),
    ):
        env = {
            **os.environ,
            "OVERLAPKIT_PLUGINS": plugins,
            "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        result = subprocess.run(
            [sys.executable, "-m", "overlapkit", "list"], capture_output=True, text=True, env=env
        )
        assert result.returncode == 2 and said in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and "internal error" not in result.stderr


def test_ctrl_c_while_the_command_is_still_importing_ends_quietly(monkeypatch, capsys):
    import builtins

    from overlapkit.console import main as command

    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "cli":  # `from .cli import main`: torch and the rest still loading
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    assert command() == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_a_name_that_would_put_run_folders_elsewhere_is_refused(tiny_scenario):
    for name in ("../../escaped", "a/b", ".hidden", '""'):
        code, _, err = cli("check", tiny_scenario(), "--set", f"name={name}")
        assert code == 2 and "names the run folders" in err, (name, err)
    assert cli("check", tiny_scenario(), "--set", "name=resnet50-cifar_v2.1")[0] == 0


def test_a_knob_in_exponent_notation_without_a_dot_is_a_number(tiny_scenario):
    # YAML 1.1 (PyYAML) reads 3e-2 as a string; train.optimizer.lr=3e-4 was accepted already.
    code, out, err = cli(
        "check",
        tiny_scenario(),
        "--set",
        "optimizations.checkpoint={every: auto, max_overhead: 3e-2}",
    )
    assert code == 0, err
    assert "0.03" in out


def test_settings_that_would_do_nothing_are_refused(tiny_scenario):
    for overrides, said in (
        (["train.eval={at_end: true}", "data.eval_samples=0"], "but data.eval_samples is 0"),
        (
            ["optimizations.checkpoint.max_overhead=0.01"],
            "max_overhead means something only when auto is on",
        ),
        (
            ["optimizations.checkpoint={every: 5}", "tune={search: {checkpoint: [max_overhead]}}"],
            "tune.search.checkpoint.max_overhead: max_overhead means something only",
        ),
    ):
        sets = [word for override in overrides for word in ("--set", override)]
        code, _, err = cli("check", tiny_scenario(), *sets)
        assert code == 2 and said in err, (overrides, err)
    auto = ["optimizations.checkpoint={every: auto}", "tune={search: {checkpoint: [max_overhead]}}"]
    assert cli("check", tiny_scenario(), *[w for o in auto for w in ("--set", o)])[0] == 0


def test_yes_or_true_where_a_number_belongs_is_not_read_as_1(tiny_scenario):
    # YAML reads yes/no/on/off as booleans, and pydantic took true as 1: a 1-step run.
    for override, key in (
        ("train.steps=yes", "train.steps"),
        ("train.eval={every: on}", "train.eval.every"),
    ):
        code, _, err = cli("check", tiny_scenario(), "--set", override)
        assert code == 2 and f"--set {override}: {key}:" in err and "needs a number" in err, err
    assert cli("check", tiny_scenario(), "--set", "train.deterministic=yes")[0] == 0  # a flag


def test_a_set_that_breaks_a_section_is_named_not_the_files_line(tiny_scenario):
    """A --set inside a section the file has (a section's own check, or a value a --set
    turned into a section) was blamed on the file's line, with pydantic's raw words."""
    scenario = tiny_scenario()
    code, _, err = cli(
        "check", scenario, "--set", "scheduler.partition.background_nice=25",
        "--set", "scheduler.policy=partition",
    )  # fmt: skip
    assert code == 2, err
    assert "--set scheduler.partition.background_nice=25: scheduler:" in err, err
    assert "Value error" not in err and "{'policy'" not in err, err
    code, _, err = cli("check", scenario, "--set", "train.steps.x=1")
    assert code == 2 and "--set train.steps.x=1: train.steps:" in err, err


def test_an_internal_error_whose_text_holds_brackets_is_printed_not_a_traceback(
    tiny_scenario, monkeypatch
):
    """Seen in CI: a rank's gloo error ("... [/__w/.../pair.cc:553] Connection closed by
    peer") was printed as rich markup, which raised MarkupError: a traceback."""
    import overlapkit.cli

    def broken(*args, **kwargs):
        raise RuntimeError("[/__w/pytorch/gloo/transport/tcp/pair.cc:553] Connection closed")

    monkeypatch.setattr(overlapkit.cli, "load_scenario", broken)
    code, _, err = cli("check", tiny_scenario())
    assert code == 1 and "internal error" in err and "pair.cc:553] Connection closed" in err


def test_one_line_warnings_leave_recording_and_other_warnings_alone():
    """The CLI's one-line form replaced warnings.showwarning, which turned off
    catch_warnings(record=True) (pytest.warns) for the rest of the process."""
    import warnings

    from overlapkit.runtime.script import LoopWarning
    from overlapkit.warnings_line import one_line_warnings

    one_line_warnings()
    with pytest.warns(LoopWarning, match="recorded"):
        warnings.warn("recorded", LoopWarning, stacklevel=2)
    assert warnings.formatwarning("x", LoopWarning, "f.py", 1) == "overlapkit: warning: x\n"
    assert "f.py:1: UserWarning: y" in warnings.formatwarning("y", UserWarning, "f.py", 1)


@pytest.mark.parametrize("at", ["step_start", "step_end"])
def test_a_plugins_error_on_one_of_two_ranks_is_one_line_naming_it_and_a_file(
    tiny_scenario, tmp_path, at
):
    """It printed "run failed: rank 1" and the rank's whole traceback (~60 lines on
    TensorFlow); one rank alone gets one line and error.txt. The error is the plugin's
    (it was called a bug in overlapkit), and one raised in a STEP_END hook is raised
    once (the loop's generator ended the step again as it closed, printing "Exception
    ignored in: <generator object Session.steps>" and a second traceback)."""
    out = tmp_path / "run"
    result = run_cli(
        "run", tiny_scenario(), "--out", out, "--set", "world.nprocs=2",
        "--set", f"optimizations.toy_fail={{rank: 1, step: 1, at: {at}}}",
    )  # fmt: skip
    assert result.returncode == 1
    said = [line for line in result.stderr.splitlines() if line.startswith("run failed")]
    assert len(said) == 1, result.stderr[-3000:]
    assert said[0].startswith("run failed: rank 1: error in the plugin toy_plugins (")
    assert "toy_plugins.py:" in said[0] and "Exception ignored" not in result.stderr
    assert "RuntimeError: toy failure on rank 1 at step 1" in said[0]
    assert said[0].endswith(f"; the traceback is in {out / 'error.txt'}")
    assert "Traceback" not in result.stderr
    assert "toy failure on rank 1" in (out / "error.txt").read_text()


def test_a_stop_no_rank_reported_reads_the_newest_checkpoint_from_the_folder(tmp_path):
    """A run whose ranks could not say where they stopped (killed at the end of the
    launcher's wait) was told 'no checkpoint was written, so the run starts over'
    beside a folder holding checkpoints."""
    import argparse
    import json
    import signal

    from overlapkit.cli import _stopped_line
    from overlapkit.launch.interrupt import RunInterrupted

    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    manifest = {"checkpoints": [{"step": 225, "files": {}}, {"step": 230, "files": {}}]}
    (checkpoints / "manifest.json").write_text(json.dumps(manifest))
    where = {"folder": tmp_path / "run", "checkpoints": checkpoints}
    line = _stopped_line(
        RunInterrupted(signal.SIGTERM), argparse.Namespace(), ["run", "s.yaml"], where
    )
    assert "the newest checkpoint is step 230. Resume: overlapkit run s.yaml" in line, line
    fresh = argparse.Namespace(fresh=True)  # those are the checkpoints it starts over from
    line = _stopped_line(RunInterrupted(signal.SIGTERM), fresh, ["run", "s.yaml"], where)
    assert "no checkpoint was written" in line
    (checkpoints / "manifest.json").unlink()
    line = _stopped_line(
        RunInterrupted(signal.SIGTERM), argparse.Namespace(), ["run", "s.yaml"], where
    )
    assert "no checkpoint was written" in line


def test_a_rank_killed_by_a_signal_says_where_the_other_ranks_errors_are(tmp_path):
    """It read 'the other ranks' errors: the traceback is in .../error.txt'."""
    from overlapkit.cli import _rank_failed
    from overlapkit.launch.local import RankFailedError

    error = RankFailedError(1, "died with SIGKILL (exit code -9)\nrank 0: ConnectionError ...")
    line = _rank_failed(error, tmp_path)
    assert line == (
        "run failed: rank 1: died with SIGKILL (exit code -9); the other ranks' errors are "
        f"in {tmp_path / 'error.txt'}"
    )
    assert "ConnectionError" in (tmp_path / "error.txt").read_text()


def test_image_folder_splits_are_labelled_by_class_name_and_every_class_has_images(
    tiny_scenario, tmp_path
):
    """A val/ split lacking one of train/'s class folders was labelled by position (its
    'c' got train's 'b' label): the evaluation was wrong, silently. A class folder with
    no image was a class the model never saw (or, all empty, passed `check`)."""
    from overlapkit.data import ImageFolderConfig

    images = image_folder(tmp_path / "images")  # train/a, train/b, train/c
    (images / "val").mkdir()
    for name in "ac":
        (images / "train" / name).rename(images / "val" / name)  # moved: val/a, val/c
        image_folder(tmp_path / "again", classes=name)
        (tmp_path / "again" / "train" / name).rename(images / "train" / name)
    _, val = ImageFolderConfig(name="imagefolder", root=images, size=32).build(seed=0)
    assert [label for _, label in val.samples] == [0] * 4 + [2] * 4  # a and c, not a and b
    folder = f"data={{name: imagefolder, root: {images}, size: 32}}"
    assert cli("check", tiny_scenario(), "--set", folder, "--set", "model.num_classes=3")[0] == 0
    (images / "val" / "d").mkdir()
    (images / "val" / "a" / "0.jpg").rename(images / "val" / "d" / "0.jpg")
    code, _, err = cli("check", tiny_scenario(), "--set", folder, "--set", "model.num_classes=3")
    assert code == 2 and "class folder(s) the training split lacks: d" in err, err
    (images / "val" / "d" / "0.jpg").rename(images / "val" / "a" / "0.jpg")
    (images / "val" / "d").rmdir()
    for empty in ("b", "c"):  # one class folder empty, then two
        for image in (images / "train" / empty).iterdir():
            image.unlink()
        code, _, err = cli(
            "check", tiny_scenario(), "--set", folder, "--set", "model.num_classes=3"
        )
        assert code == 2 and f"{images / 'train' / 'b'} holds no image" in err, err


def check_under(program: str, scenario) -> subprocess.CompletedProcess:
    """``overlapkit check SCENARIO`` run by ``program`` (which ends in the CLI's main)."""
    return subprocess.run(
        [sys.executable, "-c", program, "check", str(scenario)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("module", ["numpy", "numpy.lib._format_impl"])
def test_ctrl_c_while_torch_imports_numpy_is_not_swallowed(tiny_scenario, module):
    """torch imports numpy from its C extension's start and drops any error that raises:
    Ctrl-C there was ignored (the run went on to the end, exit 0) or left numpy half
    imported (an internal error: RecursionError). Played here as the signal itself,
    sent as that module starts to import."""
    program = textwrap.dedent(
        f"""
        import os, signal, sys

        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's

        class CtrlC:
            def find_spec(self, name, path=None, target=None):
                if name == {module!r}:
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        sys.meta_path.insert(0, CtrlC())
        from overlapkit.console import main
        sys.exit(main())
        """
    )
    result = check_under(program, tiny_scenario())
    assert result.returncode == 130, result.stdout[-500:] + result.stderr[-2000:]
    assert result.stderr == "interrupted\n", result.stderr[-2000:]


def test_ctrl_c_as_the_interpreter_exits_after_the_command_prints_no_traceback(tiny_scenario):
    """Ctrl-C just after a run's last line ("results in ...") came while the interpreter
    ran its exit hooks (torch's): "Exception ignored in atexit callback" and a
    traceback. Played here from an exit hook that runs after torch's."""
    program = textwrap.dedent(
        """
        import atexit, os, signal, sys

        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's

        def ctrl_c():
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))  # the signal's handler runs here

        atexit.register(ctrl_c)  # before torch's: run after them
        from overlapkit.console import main
        sys.exit(main())
        """
    )
    result = check_under(program, tiny_scenario())
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, (
        result.stderr[-2000:]
    )
    assert result.returncode == -signal.SIGINT and "ok, as it will run" in result.stdout


def test_ctrl_c_while_the_summary_prints_says_the_run_finished(
    tiny_scenario, tmp_path, monkeypatch
):
    """Ctrl-C once summary.json was written, as the table printed, said "stopped at step
    8 ... Resume: overlapkit run ... --out DIR", a command that is then refused: the run
    had trained all its steps."""
    from overlapkit.runtime import session

    def ctrl_c(summary: dict) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # the signal's handler runs here

    monkeypatch.setattr(session, "print_summary", ctrl_c)
    out = tmp_path / "run"
    scenario = tiny_scenario(TINY_SCENARIO + "optimizations: {checkpoint: {every: 2}}\n")
    kept = signal.getsignal(signal.SIGINT)  # a stopped run leaves SIGINT ignored
    try:
        code, _, err = cli("run", scenario, "--out", out, "--set", "train.steps=2")
    finally:
        signal.signal(signal.SIGINT, kept)
    assert code == 130 and "Resume" not in err, err
    assert f"stopped by SIGINT after the run's last step (4); its results are in {out}" in err
    assert (out / "summary.json").is_file()


def test_values_no_run_can_use_are_refused_not_met_in_the_ranks(tiny_scenario):
    """Each was accepted by check: an infinite learning rate or weight decay trained to a
    NaN loss and exit 0; the rest were internal errors once the rank ran them (a sleep
    of inf ms, torch's seed of 2**76 and Adam's beta of 2, a learning rate past a float32)."""
    for override, key in (
        ("train.optimizer.lr=.inf", "train.optimizer.lr"),
        ("train.optimizer.lr=1e300", "train.optimizer.lr"),
        ("train.optimizer.weight_decay=.inf", "train.optimizer.weight_decay"),
        ("train.lr_schedule={name: step, gamma: .inf}", "train.lr_schedule.gamma"),
        ("data.sample_cost_ms=.inf", "data.sample_cost_ms"),
        ("data.sample_cost_ms=1e300", "data.sample_cost_ms"),
        ("tune.mtbf_hours=.inf", "tune.mtbf_hours"),
        ("train.optimizer={name: adam, betas: [2, 0.999]}", "train.optimizer.betas.0"),
        ("train.seed=99999999999999999999999", "train.seed"),
    ):
        code, _, err = cli("check", tiny_scenario(), "--set", override)
        assert code == 2 and f"--set {override}: {key}:" in err, (override, err)


def test_a_ray_room_timeout_that_is_no_number_is_named_when_ray_is_used(tiny_scenario, monkeypatch):
    """OVERLAPKIT_RAY_ROOM_TIMEOUT_S was read as the CLI imported: 'abc' (or an empty
    value, unset the shell's way) was a traceback from every command, check and list
    too; nan or -5 were taken (a run on the cluster gave up at once, or never)."""
    env = {**os.environ, "OVERLAPKIT_RAY_ROOM_TIMEOUT_S": "abc"}
    result = subprocess.run(
        [sys.executable, "-m", "overlapkit", "check", str(tiny_scenario())],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for value in ("abc", "nan", "-5", "0"):
        monkeypatch.setenv("OVERLAPKIT_RAY_ROOM_TIMEOUT_S", value)
        code, _, err = cli("run", tiny_scenario(), "--ray", "127.0.0.1:1")
        assert code == 2 and f"OVERLAPKIT_RAY_ROOM_TIMEOUT_S is {value!r}" in err, err
    from overlapkit.launch.ray_nodes import room_timeout_s

    monkeypatch.setenv("OVERLAPKIT_RAY_ROOM_TIMEOUT_S", "")
    assert room_timeout_s() == 900  # empty: unset
    monkeypatch.setenv("OVERLAPKIT_RAY_ROOM_TIMEOUT_S", "12.5")
    assert room_timeout_s() == 12.5


def test_ctrl_c_while_the_trials_server_imports_torch_prints_no_traceback(tmp_path):
    """A tune's trials start from a server that imports torch first (seconds), in the
    terminal's process group: Ctrl-C then printed its KeyboardInterrupt traceback (one
    per worker). Played as the signal itself, sent as the server imports its last
    module; the trial it then starts still stops on SIGINT (its handler restored)."""
    (tmp_path / "ctrl_c_now.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nsum(range(1000))\n"
    )
    (tmp_path / "sigint_probe.py").write_text(
        "import os, signal\n"
        "with open(os.environ['PROBE_FILE'], 'w') as f:\n"
        "    f.write(str(signal.getsignal(signal.SIGINT) is signal.default_int_handler))\n"
    )
    program = textwrap.dedent(
        f"""
        import os, signal, sys
        from overlapkit.tuning import trial_process

        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's

        trial_process.PRELOAD.append("ctrl_c_now")
        env = {{**os.environ, "OVERLAPKIT_PLUGINS": "sigint_probe"}}
        out, err = {str(tmp_path / "out.txt")!r}, {str(tmp_path / "err.txt")!r}
        process = trial_process.start_trial_process(["list"], out, err, env, fork=True)
        sys.exit(process.wait())
        """
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    probe = tmp_path / "probe.txt"
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": path, "PROBE_FILE": str(probe)},
    )
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0, (tmp_path / "err.txt").read_text()[-2000:]
    assert probe.read_text() == "True"


def test_a_path_argument_starting_with_a_tilde_is_in_the_home_folder(
    tiny_scenario, tmp_path, monkeypatch
):
    """`--out=~/runs/x` (a shell expands no ~ after '='), or a quoted '~/...', made a
    folder named '~' in the current folder, and the scenario '~/s.yaml' was "not
    found": only checkpoint.dir and data.root read ~ as the home folder."""
    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir()
    here.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    tiny_scenario().rename(home / "s.yaml")
    code, _, err = cli(
        "run", "~/s.yaml", "--out=~/r1", "--quiet", "--set", "train.steps=1",
        "--set", "train.warmup_steps=0", "--set", "optimizations.checkpoint={every: 1}",
    )  # fmt: skip
    assert code == 0, err
    assert (home / "r1" / "summary.json").is_file() and not (here / "~").exists()
    assert cli("compare", "~/r1", "--out", "~/cmp")[0] == 0
    assert cli("export", "~/r1", "--to", "~/model.pt")[0] == 0
    assert (home / "cmp" / "compare.json").is_file() and (home / "model.pt").is_file()
    from overlapkit.scenarios import load_scenario

    board = load_scenario(home / "s.yaml", ["log.tensorboard=~/tb"]).log.tensorboard
    assert board == str(home / "tb")
    assert list(here.iterdir()) == []
    # ~user of no such user: one line (a traceback, and an internal error, before)
    code, _, err = cli("compare", "~nosuchuser8/r1")
    assert code == 2 and "~nosuchuser8/r1" in err and "Traceback" not in err, err
    code, _, err = cli("check", home / "s.yaml", "--set", "log.tensorboard=~nosuchuser8/tb")
    assert code == 2 and "~nosuchuser8/tb" in err and "internal error" not in err, err


def test_a_checkpoint_dir_that_cannot_be_written_is_refused_before_any_rank_starts(
    tiny_scenario, tmp_path, monkeypatch
):
    """check said ok; the run made its folder and then failed with exit 1 ("run failed:
    cannot create the checkpoint folder ..."). A read-only folder is played by os.access
    (tests may run as root, who writes anywhere a file system lets)."""
    shut = tmp_path / "shut"
    shut.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != shut and real_access(p, mode))
    scenario, out = tiny_scenario(), tmp_path / "run"
    for argv in (["check", scenario], ["run", scenario, "--out", out]):
        code, _, err = cli(*argv, "--set", f"optimizations.checkpoint.dir={shut}/ck")
        assert code == 2 and f"checkpoint.dir {shut}/ck: {shut} cannot be written" in err, err
    assert not out.exists()
    code, _, err = cli(
        "run", scenario, "--out", out, "--set", "optimizations.checkpoint.dir=../shut"
    )
    assert code == 2 and f"{shut} cannot be written" in err and not out.exists(), err


def test_compare_of_a_summary_with_a_section_of_the_wrong_kind_names_it(tmp_path):
    """A summary.json whose pop or optimizations was no table (edited by hand, or
    written by something else) was an internal error (AttributeError) in compare."""
    summary = {"samples_per_s": 10.0, "step_time_s": {"p50": 0.1}, "phases_s": {}}
    for number, (key, value, said) in enumerate(
        (
            ("pop", None, "pop is null, not a table"),
            ("pop", {"load_balance": "high"}, 'pop.load_balance is "high", not a number'),
            ("optimizations", [1], "optimizations is [1], not a table"),
            ("optimizations", {"checkpoint": 3}, "optimizations.checkpoint is 3, not a table"),
        )
    ):
        run = tmp_path / f"run{number}"
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({**summary, key: value}))
        code, _, err = cli("compare", run, "--out", tmp_path / "cmp")
        assert code == 2 and f"not an overlapkit run summary ({said})" in err, err


def test_export_names_a_file_given_where_a_folder_belongs(tmp_path):
    """A file given as the run folder was "no such run folder", and one in the way of
    --to's folder "its folder ... does not exist": both are there, as files."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    code, _, err = cli("export", afile)
    assert code == 2 and f"{afile}: a file; name a run folder" in err, err
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"checkpoints": []}))
    code, _, err = cli("export", run.parent, "--to", afile / "model.pt")
    assert code == 2 and f"--to {afile / 'model.pt'}: {afile} is a file" in err, err
    assert afile.read_text() == "mine"


def test_a_run_out_of_memory_is_not_called_a_bug(tiny_scenario, tmp_path, monkeypatch):
    """data.shape [3, 20000, 20000] (19 GB a sample) said "internal error (a bug in
    overlapkit; please report it): RuntimeError: ... DefaultCPUAllocator: can't allocate
    memory", on one rank or from one of several; a tune's trial was 'crashed'."""
    import overlapkit.run
    from overlapkit.cli import _rank_failed
    from overlapkit.launch.local import RankFailedError

    said = (
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 19200000000 bytes. Error code 12"
    )

    def too_big(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError(said)

    monkeypatch.setattr(overlapkit.run, "run_scenario", too_big)
    code, _, err = cli("run", tiny_scenario(), "--out", tmp_path / "run")
    assert code == 1 and "internal error" not in err, err
    assert f"run failed: out of memory: RuntimeError: {said}" in err, err
    raised = {"type": "builtins:RuntimeError", "message": said}
    line = _rank_failed(RankFailedError(1, f"Traceback ...\n{said}", raised), tmp_path)
    assert line.startswith(f"run failed: rank 1: out of memory: RuntimeError: {said}"), line


def test_a_study_tuned_with_another_tune_section_is_not_continued(tmp_path):
    """The same --out with another tune.steps (or search, intensity_step, objective...)
    continued the study: trials of two lengths ranked side by side, silently; another
    search ran its trials and then failed in the report (KeyError: an internal error).
    Another tune.mtbf_hours was taken, and the report priced goodput at the first one."""
    from overlapkit.tuning import TuneConfig, TuneError
    from overlapkit.tuning.study import TuneJob, default_storage, open_study

    # (toy_sleep beside the checkpoint: a goodput study has something to search once the
    # model sets the checkpoint's interval)
    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"checkpoint": {}, "toy_sleep": {}}}
    storage = default_storage(tmp_path)
    open_study(TuneJob(base, TuneConfig(trials=2), tmp_path, storage, "tiny"))
    # What only the study's later phases, its length or its report read may change.
    same = TuneConfig(trials=20, finalists=1, repeats=5, prune=False, mtbf_hours=3)
    assert open_study(TuneJob(base, same, tmp_path, storage, "tiny")).user_attrs["tune"] == (
        same.model_dump(mode="json")
    )
    for changed, said in (
        ({"steps": 20}, "tune.steps 12 -> 20"),
        ({"search": {"checkpoint": {"every": [2, 3]}}}, "tune.search unset -> {'checkpoint'"),
        ({"intensity_step": 0.5}, "tune.intensity_step 0.25 -> 0.5"),
        ({"objective": "goodput"}, "tune.objective throughput -> goodput"),
    ):
        with pytest.raises(TuneError, match="tuned with another tune section") as error:
            open_study(TuneJob(base, TuneConfig(trials=2, **changed), tmp_path, storage, "tiny"))
        assert said in str(error.value), str(error.value)

"""framework: tensorflow: real TensorFlow workers on MultiWorkerMirroredStrategy (CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import cli_here, free_port, run_cli, step_losses

pytest.importorskip("tensorflow")

from overlapkit.optimizations.prefetch.tfdata_backend import START_UP_CHATTER  # noqa: E402

BERT = {
    "name": "tf-bert",
    "framework": "tensorflow",
    "model": {
        "name": "bert",
        "vocab_size": 512,
        "hidden": 128,
        "layers": 2,
        "heads": 2,
        "max_len": 16,
        "dropout": 0.0,
    },
    "data": {
        "name": "synthetic-tokens",
        "seq_len": 16,
        "vocab_size": 512,
        "num_samples": 256,
        "eval_samples": 32,
    },
    "train": {
        "batch_size": 8,
        "steps": 4,
        "warmup_steps": 4,
        "deterministic": True,
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    },
    "world": {"nprocs": 2},
}
RESNET = {
    "name": "tf-resnet",
    "framework": "tensorflow",
    "model": {"name": "resnet18", "stem": "cifar", "num_classes": 10, "width": 4},
    "data": {"name": "synthetic-images", "shape": [3, 8, 8], "num_samples": 256, "eval_samples": 0},
    "train": {
        "batch_size": 8,
        "steps": 6,
        "warmup_steps": 2,
        "deterministic": True,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    },
    "world": {"nprocs": 1},
    "optimizations": {"checkpoint": {"every": 2}},
}


def scenario_file(folder: Path, base: dict, **changes) -> Path:
    document = json.loads(json.dumps(base))
    for dotted, value in changes.items():
        *path, key = dotted.split("__")
        node = document
        for part in path:
            node = node.setdefault(part, {})
        node[key] = value
    path = folder / f"{document['name']}-{len(list(folder.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def run(scenario: Path, out: Path, *extra: str) -> dict:
    result = run_cli("run", scenario, "--out", out, "--json", *extra, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not any(words in result.stderr for words in START_UP_CHATTER), result.stderr
    return json.loads((out / "summary.json").read_text())


def test_what_tensorflow_writes_at_import_is_held_back_but_for_its_chatter(capfd):
    """TensorFlow's import wrote four lines a rank (oneDNN's notice, each after absl's
    warning that logging has not started), whatever TF_CPP_MIN_LOG_LEVEL said."""
    from overlapkit.optimizations.prefetch.tfdata_backend import _stderr_without

    with _stderr_without(START_UP_CHATTER):
        os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called ...\n")
        os.write(2, b"I0000 port.cc:153] oneDNN custom operations are on. You may see\n")
        os.write(2, b"E0000 something TensorFlow really means\n")
    assert capfd.readouterr().err == "E0000 something TensorFlow really means\n"
    # A crash inside loses nothing written before it (it was held until the end).
    crash = textwrap.dedent(
        """
        import os
        from overlapkit.optimizations.prefetch.tfdata_backend import _stderr_without
        with _stderr_without(("chatter",)):
            os.write(2, b"F0000 the reason TensorFlow aborts\\n")
            os.write(2, b"some chatter\\n")
            os.abort()  # at once: its own threads read nothing more
        """
    )
    aborted = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True)
    assert aborted.returncode == -signal.SIGABRT
    assert aborted.stderr == "F0000 the reason TensorFlow aborts\n"


@pytest.mark.slow
def test_two_workers_equal_one_worker_on_the_global_batch_and_packs_follow_the_knob(tmp_path):
    # Two workers with 8 samples each read, together, the 16 samples one worker reads.
    packed = run(
        scenario_file(tmp_path, BERT, optimizations={"ddp_overlap": {"bucket_cap_mb": 0.5}}),
        tmp_path / "two",
    )
    one = run(
        scenario_file(tmp_path, BERT, world__nprocs=1, train__batch_size=16),
        tmp_path / "one",
        "--tensorboard",
        str(tmp_path / "board"),
    )
    assert packed["strategy"]["replicas"] == 2 and one["strategy"]["replicas"] == 1
    assert packed["strategy"]["replicas_identical"]  # every weight, bit for bit
    two_losses, one_losses = step_losses(tmp_path / "two"), step_losses(tmp_path / "one")
    for step in range(8):
        mean_of_ranks = (two_losses[(step, 0)] + two_losses[(step, 1)]) / 2
        assert mean_of_ranks == pytest.approx(one_losses[(step, 0)], rel=2e-4, abs=2e-5)
    # TensorBoard gets the TensorFlow loop's steps too, as the torch loop's.
    from test_tensorboard import scalars

    logged = scalars(tmp_path / "board")
    assert logged["train/loss"] == [(s, pytest.approx(one_losses[(s, 0)])) for s in range(8)]
    assert "phases_ms/compiled_step" in logged or "phases_ms/data_wait" in logged
    # bytes_per_pack from bucket_cap_mb: the ~1.6 MB of dense gradients in 0.5 MB packs
    # are several all-reduces; intensity 0 (bytes_per_pack 0) is one, after backward.
    one_pack = run(
        scenario_file(tmp_path, BERT, optimizations={"ddp_overlap": {"intensity": 0}}),
        tmp_path / "flat",
    )
    assert one_pack["optimizations"]["ddp_overlap"]["bytes_per_pack"] == 0
    assert one_pack["strategy"]["allreduce_packs_per_step"] == 1
    assert one_pack["strategy"]["collective_ops_per_step"]["CollectiveReduceV2"] == 1
    assert packed["optimizations"]["ddp_overlap"]["bytes_per_pack"] == 512 * 1024
    assert packed["strategy"]["allreduce_packs_per_step"] >= 3
    assert packed["optimizations"]["ddp_overlap"]["packs_per_step"] >= 3
    # Packs overlap backward only with a second inter-op thread: said when there is none.
    told = packed["optimizations"]["ddp_overlap"].get("notes", [])
    alone = packed["strategy"]["inter_op_threads"] == 1
    assert any("one inter-op thread per worker" in note for note in told) == alone, told
    # The compiled step was split by a sampled profile, and says so.
    assert "sampled TensorFlow profile" in packed["phases_source"]
    # Each worker's compute would be rank 0's fractions of a step as long as every
    # other's: load balance was ~1.0 whatever each worker computed. Not measured now.
    assert packed["pop"]["load_balance"] is None and packed["pop"]["parallel_efficiency"] is None
    assert packed["pop"]["communication_efficiency"] is not None
    assert any("load balance" in note for note in packed["notes"])
    assert packed["phases_s"]["backward"] > 0 and packed["phases_s"]["forward"] > 0


def test_ddp_overlap_says_when_its_packs_cannot_overlap_backward():
    """At intensities 0.25 to 0.75 a small model's gradients fit in one pack: the same
    program as intensity 0, summarised as mode=overlap. With one inter-op thread per
    worker TensorFlow runs the packs after backward. Both were unsaid."""
    from overlapkit.optimizations import get_optimization
    from overlapkit.optimizations.ddp_overlap.tensorflow import engine

    overlap = engine(get_optimization("ddp_overlap")(0.5))
    one_pack = overlap.no_overlap_notes({"replicas": 2, "allreduce_packs_per_step": 1})
    assert len(one_pack) == 1 and "one pack per step" in one_pack[0]
    packs = {"replicas": 2, "allreduce_packs_per_step": 3}
    (alone,) = overlap.no_overlap_notes({**packs, "inter_op_threads": 1})
    assert "one inter-op thread" in alone and "world.threads: 2" in alone
    assert overlap.no_overlap_notes({**packs, "inter_op_threads": 2}) == []
    assert overlap.no_overlap_notes({"replicas": 1, "allreduce_packs_per_step": 1}) == []
    flat = engine(get_optimization("ddp_overlap")(0.0))  # intensity 0: one pack, as asked
    assert flat.no_overlap_notes({"replicas": 2, "allreduce_packs_per_step": 1}) == []


SMALL_BERT = {
    **BERT,
    "name": "tf-bert-small",
    "model": {**BERT["model"], "hidden": 16, "layers": 1, "dropout": 0.1},
    "train": {**BERT["train"], "steps": 2, "warmup_steps": 1, "eval": {"at_end": True}},
    "world": {"nprocs": 1},
    "optimizations": {"checkpoint": {"every": 2}},
}

FAILING_EVAL = textwrap.dedent(
    """
    import sys
    from overlapkit.backends.tensorflow import loop

    def broken_eval_step(tf, model):
        def step(inputs, targets):
            raise ZeroDivisionError("injected evaluation failure")
        return step

    loop.make_eval_step = broken_eval_step
    from overlapkit.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def test_bert_evaluates_at_the_end_traces_hooks_and_a_failed_eval_keeps_the_training(tmp_path):
    scenario = scenario_file(tmp_path, SMALL_BERT)
    # The model is called outside strategy.run; the hooks are traced as the loop fires them.
    summary = run(
        scenario,
        tmp_path / "ok",
        *("--set", "scheduler.trace=true", "--set", "optimizations.prefetch={autotune: true}"),
    )
    prefetch = summary["optimizations"]["prefetch"]  # what ran, not the knobs' defaults
    assert prefetch["backend"] == "tfdata" and prefetch["workers"] == "tf.data's (autotune)"
    assert summary["eval"]["runs"][0]["step"] == 3 and summary["eval"]["runs"][0]["samples"] == 32
    events = json.loads((tmp_path / "ok" / "trace.json").read_text())["traceEvents"]
    ends = [e["args"]["step"] for e in events if e["name"] == "checkpoint.step_end"]
    assert ends == [0, 1, 2] and any("trace.json" in note for note in summary["notes"])
    # overlapkit export: the variables by their paths, which the model takes.
    exported = run_cli("export", tmp_path / "ok", "--json")
    assert exported.returncode == 0, exported.stderr
    done = json.loads(exported.stdout)
    assert done["framework"] == "tensorflow" and done["path"].endswith(".npz")
    import keras
    import numpy as np

    from overlapkit.backends.tensorflow.models import build_model
    from overlapkit.scenarios.loader import load_scenario

    weights = np.load(done["path"])
    keras.backend.clear_session()  # Keras names a layer by how many this process built
    model = build_model(load_scenario(tmp_path / "ok" / "scenario.yaml").model, (16,))
    assert weights.files == [v.path for v in model.variables] and done["by_position"] is False
    for variable, key in zip(model.variables, weights.files, strict=True):
        variable.assign(weights[key])  # every shape and dtype fits
    out = tmp_path / "failed"
    result = subprocess.run(
        [sys.executable, "-c", FAILING_EVAL, "run", str(scenario), "--out", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode != 0
    assert "injected evaluation failure" in (out / "error.txt").read_text()
    kept = json.loads((out / "summary.json").read_text())
    assert "eval" not in kept
    assert any("evaluation at the end failed" in note for note in kept["notes"])
    assert sorted(step_losses(out)) == [(0, 0), (1, 0), (2, 0)]
    manifest = json.loads((out / "checkpoints" / "manifest.json").read_text())["checkpoints"]
    assert [e["step"] for e in manifest] == [2, 3]  # the final checkpoint too


def test_an_unprofiled_compiled_step_is_not_measured_and_a_resumed_run_profiles_anew(tmp_path):
    import shutil

    out = tmp_path / "run"
    short = scenario_file(tmp_path, RESNET, train__warmup_steps=0, train__steps=1)
    result = run_cli(
        "run", short, "--out", out, "--set", "scheduler.policy=priority", timeout=280
    )  # the console, not --json
    assert result.returncode == 0, result.stderr[-3000:]
    # priority runs as free there: said as the run starts (it was in summary.json only)
    assert "overlapkit: scheduler.policy priority: nothing inside a compiled" in result.stderr
    lines = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if "│" in line}
    for row in ("load balance", "parallel efficiency", "forward", "comm_exposed"):
        assert "not measured" in lines[row], lines[row]
    unsplit = json.loads((out / "summary.json").read_text())
    assert unsplit["pop"] == dict.fromkeys(
        ("load_balance", "communication_efficiency", "parallel_efficiency")
    )
    for phase in ("forward", "backward", "comm_exposed", "optimizer"):
        assert unsplit["phases_s"][phase] is None
    assert unsplit["compiled_step_s"] > unsplit["phases_s"]["other"]  # not counted in other
    assert "too few steps to profile" in unsplit["phases_source"]
    assert unsplit["phases_profiled_steps"] is None
    shutil.copytree(out, tmp_path / "unsplit")
    # Resumed past the warm-up's window: it profiles the steps after its own first.
    resumed = run(scenario_file(tmp_path, RESNET, train__warmup_steps=0, train__steps=4), out)
    assert resumed["resumed_from_step"] == 1
    assert resumed["phases_profiled_steps"] == [2, 3]
    assert resumed["phases_s"]["forward"] > 0 and resumed["pop"]["load_balance"] == 1.0
    table = cli_here("compare", tmp_path / "unsplit", out, "--out", tmp_path / "c").stdout
    assert "n/a" in table
    caption = table[table.index("phases split from a sampled profile") :]
    assert "run" in caption and "unsplit" not in caption


def test_every_optimizers_update_is_counted_as_the_optimizer_phase():
    """Keras names AdamW ``adam_w``: its update ops were counted as forward, and the
    optimizer phase was 0 for every adamw run (the BERT scenarios)."""
    from typing import get_args

    from overlapkit.backends.tensorflow.profile import OPTIMIZER_SCOPES, _category
    from overlapkit.backends.tensorflow.step import build_optimizer
    from overlapkit.runtime.loop import OptimizerConfig, TrainConfig

    for name in get_args(OptimizerConfig.model_fields["name"].annotation):
        cfg = TrainConfig(batch_size=8, steps=4, optimizer=OptimizerConfig(name=name))
        scope = build_optimizer(cfg).name
        assert scope in OPTIMIZER_SCOPES, name
        assert _category(f"{scope}/update/Mul:Mul", OPTIMIZER_SCOPES) == "optimizer"


def test_the_profile_window_after_a_resume_and_why_there_is_none():
    from overlapkit.backends.tensorflow.profile import profile_window, why_unprofiled

    window = profile_window(warmup_steps=2, total_steps=8, start=0, rank=0)
    assert (window.start, window.stop) == (1, 2)  # the warm-up's, after the first step
    window = profile_window(warmup_steps=2, total_steps=8, start=4, rank=0)
    assert (window.start, window.stop) == (5, 8)  # after the resumed run's own first
    assert profile_window(warmup_steps=2, total_steps=5, start=4, rank=0) is None
    assert "resumed at step 4 with 1 step(s) left" in why_unprofiled(5, 4)
    assert profile_window(warmup_steps=0, total_steps=1, start=0, rank=0) is None
    assert "train.warmup_steps + train.steps = 1" in why_unprofiled(1, 0)


def test_prefetched_batches_equal_the_synchronous_ones():
    import tensorflow as tf

    from overlapkit.backends.tensorflow.data import Batches, InputPlan
    from overlapkit.data import SyntheticImages, build_loaders

    train, _ = build_loaders(SyntheticImages((3, 8, 8), num_samples=96), None, 8, 1, 2, seed=3)
    batches = Batches(train)
    plain = list(batches.train(tf, 9, 2, InputPlan(), None))  # across an epoch's end
    ahead = list(batches.train(tf, 9, 2, InputPlan(workers=3, depth=4), None))
    assert len(plain) == len(ahead) == 7
    for (x, y), (x2, y2) in zip(plain, ahead, strict=True):
        assert np.array_equal(x.numpy(), x2.numpy()) and np.array_equal(y.numpy(), y2.numpy())
    # The samples the torch loader reads, in its order (batch 2 on), channels last.
    order = batches.train_indices(9)[16:24]
    expected = np.stack([train.dataset[int(i)][0].numpy() for i in order])
    assert np.array_equal(plain[0][0].numpy(), expected.transpose(0, 2, 3, 1))


STALL_PERSIST = textwrap.dedent(
    """
    import sys, time
    from overlapkit.optimizations.checkpoint import persister
    original = persister.write_state

    def stalled(path, tree, gate=None):
        if "step-00000004" in str(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".partial").write_bytes(b"half")
            print("MID-PERSIST", flush=True)
            time.sleep(600)
        return original(path, tree, gate)

    persister.write_state = stalled
    from overlapkit.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.slow
def test_sigkill_mid_persist_resumes_bit_identically(tmp_path):
    scenario = scenario_file(tmp_path, RESNET)
    whole = run(scenario, tmp_path / "whole")
    out = tmp_path / "killed"
    victim = subprocess.Popen(
        [sys.executable, "-c", STALL_PERSIST, "run", str(scenario), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert victim.stdout.readline().strip() == "MID-PERSIST"
        victim.send_signal(signal.SIGKILL)
    finally:
        victim.wait(timeout=30)
    manifest = json.loads((out / "checkpoints" / "manifest.json").read_text())["checkpoints"]
    assert [e["step"] for e in manifest] == [2]  # step 4's persist never completed
    resumed = run(scenario, out)
    assert resumed["resumed_from_step"] == 2
    assert resumed["optimizations"]["checkpoint"]["resumed_from_step"] == 2
    assert resumed["strategy"]["model_sha256"] == whole["strategy"]["model_sha256"]
    whole_losses, resumed_losses = step_losses(tmp_path / "whole"), step_losses(out)
    assert all(resumed_losses[key] == whole_losses[key] for key in resumed_losses)
    assert sorted(resumed_losses) == [(s, 0) for s in range(2, 8)]


TERM_AT_STEP_5 = textwrap.dedent(
    """
    import os, signal, sys
    from overlapkit.backends.tensorflow import loop
    made = loop.make_train_step

    def make(*args):
        step, calls = made(*args), []

        def step_then_term(inputs, targets):
            calls.append(1)
            if len(calls) == 6:  # step 5: as a kill from outside, between two steps
                os.kill(os.getpid(), signal.SIGTERM)
            return step(inputs, targets)

        return step_then_term

    loop.make_train_step = make
    from overlapkit.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def test_sigterm_says_the_step_and_the_newest_checkpoint(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-c", TERM_AT_STEP_5, "run", str(scenario_file(tmp_path, RESNET))]
        + ["--out", str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 143, result.stderr[-3000:]
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("overlapkit: stopped by")]
    newest = json.loads((out / "checkpoints" / "manifest.json").read_text())["checkpoints"][-1]
    assert line.startswith("overlapkit: stopped by SIGTERM at step 5; run folder"), line
    assert f"the newest checkpoint is step {newest['step']}. Resume:" in line


@pytest.mark.slow
def test_sigterm_stops_two_workers_at_a_step(tmp_path):
    """Over two workers TensorFlow's own SIGTERM handler (its preemption notifier)
    replaced the run's: the workers trained on until the launcher killed them, and the
    line said no checkpoint was written while the folder held some."""
    out = tmp_path / "run"
    scenario = scenario_file(
        tmp_path, RESNET, world__nprocs=2, train__steps=100000, train__deterministic=False
    )
    command = [sys.executable, "-m", "overlapkit", "run", str(scenario), "--out", str(out)]
    launcher = subprocess.Popen(
        [*command, "--quiet"], stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoints" / "manifest.json").exists():
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 143, stderr[-3000:]
    (line,) = [x for x in stderr.splitlines() if x.startswith("overlapkit: stopped by")]
    assert line.startswith("overlapkit: stopped by SIGTERM at step "), line  # a rank said
    newest = json.loads((out / "checkpoints" / "manifest.json").read_text())["checkpoints"][-1]
    assert f"the newest checkpoint is step {newest['step']}. Resume:" in line
    assert "coordination_service" not in stderr  # TensorFlow's INFO lines stay out


@pytest.mark.slow
def test_a_peer_that_never_starts_is_a_clear_error_within_the_time_out(tmp_path):
    scenario = scenario_file(tmp_path, BERT, world__timeout_s=2)
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from overlapkit.backends.tensorflow.worker import tf_rank_main
        from overlapkit.scenarios import load_scenario
        tf_rank_main(load_scenario(Path({str(scenario)!r})), None, False, False)
        """
    )
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "PeerTimeoutError" in result.stderr
    assert "waited 2 s (world.timeout_s) for the other ranks" in result.stderr
    assert time.monotonic() - start < 60


def test_pipeline_is_refused_on_tensorflow_before_start(tmp_path):
    scenario = scenario_file(tmp_path, BERT, optimizations={"pipeline": {"stages": 2}})
    result = cli_here("check", scenario)
    assert result.returncode == 2
    assert "pipeline does not run on tensorflow" in result.stderr
    assert "framework: torch" in result.stderr and "backend: tfdata" in result.stderr
    torch_knob = scenario_file(tmp_path, BERT, optimizations={"ddp_overlap": {"comm_hook": "fp16"}})
    result = cli_here("check", torch_knob)
    assert result.returncode == 2 and "comm_hook is a knob of torch only" in result.stderr
    for backend in ("gloo", "nccl"):  # gloo was accepted, and ignored
        result = cli_here(
            "check", scenario_file(tmp_path, BERT), "--set", f"world.backend={backend}"
        )
        assert result.returncode == 2 and "leave it auto" in result.stderr, result.stderr


def test_cuda_without_a_gpu_is_refused_before_start(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cuda = scenario_file(tmp_path, RESNET, world__device="cuda", train__precision="fp16")
    for command in (["check"], ["run", "--out", tmp_path / "run"]):  # it trained on the CPU
        result = cli_here(*command, cuda)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "error: world.device is cuda but no CUDA device is visible" in result.stderr
    assert not (tmp_path / "run").exists()


def test_the_tune_space_holds_only_what_tensorflow_runs(tmp_path):
    backends = scenario_file(tmp_path, RESNET, tune={"search": {"prefetch": ["backend"]}})
    result = cli_here("check", backends)
    assert result.returncode == 0, result.stderr
    (row,) = [line for line in result.stdout.splitlines() if "space: prefetch.backend" in line]
    assert row.split("│")[2].strip() == "tfdata"  # torch and dali feed only torch's loop
    policy = scenario_file(tmp_path, RESNET, tune={"search": {"scheduler": ["policy"]}})
    result = cli_here("check", policy)
    assert result.returncode == 2
    assert "on tensorflow the scheduler's policy is not searched" in result.stderr
    assert "set scheduler.policy in the scenario" in result.stderr
    # device_depth does nothing without a GPU there: its trials would measure noise
    idle = scenario_file(tmp_path, RESNET, tune={"search": {"prefetch": ["device_depth"]}})
    result = cli_here("check", idle)
    assert result.returncode == 2, result.stdout
    assert "prefetch.device_depth: prefetch_to_device needs a GPU" in result.stderr


def test_the_session_api_says_it_is_torch_only_when_given_keras(tmp_path):
    import keras

    import overlapkit

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    session = overlapkit.Session([], run_dir=tmp_path / "api", print_summary=False)
    with pytest.raises(TypeError) as raised:
        session.prepare(model, keras.optimizers.SGD(0.1), None)
    said = str(raised.value)
    assert "the Session API is torch-only" in said and "framework: tensorflow" in said


def test_check_shows_the_settings_tensorflow_runs(tmp_path):
    scenario = scenario_file(
        tmp_path, BERT, optimizations={"prefetch": {"autotune": True}, "ddp_overlap": {}}
    )
    result = cli_here("check", scenario)
    assert result.returncode == 0, result.stderr
    rows, section = {}, ""
    for line in result.stdout.splitlines():
        cells = line.split("│")[1:-1]
        if len(cells) == 2 and cells[0].startswith("   "):
            rows[f"{section}.{cells[0].strip()}"] = cells[1].strip()
        elif len(cells) == 2:
            section = cells[0].strip()
    assert rows["optimizations.prefetch.backend"] == "tfdata"  # the knob's default: torch
    assert rows["optimizations.prefetch.workers"] == "tf.data's (autotune)"
    assert rows["optimizations.prefetch.depth"] == "tf.data's (autotune)"
    assert rows["optimizations.ddp_overlap.implementation"] == "auto (ring: no GPUs)"
    assert rows["tune.policy"] == "no: TensorFlow runs one policy"  # said yes
    # prefetch_to_device needs a GPU: the knob showed its number and did nothing
    assert rows["optimizations.prefetch.device_depth"] == "n/a (no GPU)"
    priority = cli_here("check", scenario, "--set", "scheduler.policy=priority")
    assert "priority (runs as free" in priority.stdout


def test_list_says_which_optimization_runs_on_which_framework():
    result = cli_here("list", "--json")
    assert result.returncode == 0
    listed = json.loads(result.stdout)["optimizations"]
    frameworks = {o["name"]: o["frameworks"] for o in listed}
    assert frameworks["pipeline"] == ["torch"]
    for name in ("ddp_overlap", "prefetch", "checkpoint"):
        assert frameworks[name] == ["torch", "tensorflow"]


@pytest.mark.slow
def test_tune_runs_a_small_study_on_a_tensorflow_scenario(tmp_path):
    scenario = scenario_file(
        tmp_path,
        RESNET,
        optimizations={"prefetch": {"intensity": 1}},
        tune={
            "trials": 1,
            "references": False,
            "finalists": 0,
            "repeats": 1,
            "policy": False,
            "steps": 2,
            "warmup_steps": 1,
            "prune": False,
        },
    )
    result = run_cli("tune", scenario, "--out", tmp_path / "study", timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    trials = json.loads((tmp_path / "study" / "tune.json").read_text())
    assert trials  # the study's results, from TensorFlow runs

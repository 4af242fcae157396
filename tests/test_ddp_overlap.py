"""ddp_overlap on 2 real gloo ranks: correctness of every mode, hook and knob, and its measurements."""

import json

import pytest
import torch
from rank_programs import mlp, train_mlp

from conftest import run_cli
from overlapkit import get_optimization
from overlapkit.launch.local import launch_local
from overlapkit.optimizations.ddp_overlap import size_class
from overlapkit.runtime import CombinationError
from overlapkit.runtime.rng import seed_everything

BATCH = 16  # per rank
STEPS = 6


def ddp(**settings):
    return {"ddp_overlap": settings}


CONFIGS = {
    "overlap": {"batch_size": BATCH, "steps": STEPS, "optimizations": ddp(intensity=1.0)},
    "tiny_buckets": {
        "batch_size": BATCH,
        "steps": STEPS,
        "optimizations": ddp(bucket_cap_mb=0.5, gradient_as_bucket_view=True),
        "record_calls": True,
    },
    "no_overlap": {"batch_size": BATCH, "steps": STEPS, "optimizations": ddp(intensity=0.0)},
    "fp16": {"batch_size": BATCH, "steps": STEPS, "optimizations": ddp(comm_hook="fp16")},
    "powersgd": {
        "batch_size": BATCH,
        "steps": STEPS,
        "optimizations": ddp(comm_hook="powersgd", powersgd_rank=2, powersgd_start_iter=2),
    },
    "powersgd_small_buckets": {
        "batch_size": BATCH,
        "steps": 4,
        "optimizations": ddp(comm_hook="powersgd", powersgd_start_iter=2, bucket_cap_mb=0.5),
    },
    "static": {"batch_size": BATCH, "steps": STEPS, "optimizations": ddp(static_graph=True)},
    "accumulate": {
        "batch_size": BATCH // 2,
        "steps": STEPS,
        "accumulate": 2,
        "optimizations": ddp(intensity=1.0),
    },
    "nccl_knobs": {
        "batch_size": BATCH,
        "steps": 3,
        "optimizations": ddp(nccl_algo="tree", nccl_proto="ll"),
    },
}


@pytest.fixture(scope="module")
def results():
    from rank_programs import ddp_configs

    return launch_local(ddp_configs, 2, CONFIGS)


def assert_close(a, b, tol=1e-5):
    assert torch.allclose(a, b, rtol=tol, atol=tol), float((a - b).abs().max())


@pytest.mark.slow
def test_replicas_stay_identical_in_every_configuration(results):
    for name in CONFIGS:
        assert torch.equal(results[0][name]["params"], results[1][name]["params"]), name


@pytest.mark.slow
def test_ddp_equals_one_process_on_the_global_batch(results):
    # Rank r's batch i is samples order[2iB + r :: 2][:B]: together, one process's batch of 2B.
    reference = train_mlp(1, 0, 2 * BATCH, STEPS, {})["params"]
    for name in ("overlap", "tiny_buckets", "no_overlap", "static", "accumulate"):
        assert_close(results[0][name]["params"], reference)
    assert not torch.equal(reference, train_mlp(1, 0, BATCH, STEPS, {})["params"])


def initial_params():
    """The MLP's parameters before training, as every rank starts from them."""
    seed_everything(0)
    return torch.cat([p.detach().reshape(-1) for p in mlp().parameters()])


@pytest.mark.slow
def test_compressing_hooks_run_and_stay_close(results):
    reference = results[0]["overlap"]["params"]
    initial = initial_params()
    moved = float((reference - initial).norm())  # what training changed, uncompressed
    assert moved > 0.1
    # fp16 rounds each gradient; PowerSGD sends a rank-2 approximation (from step 2).
    for name, bound in (("fp16", 0.02), ("powersgd", 0.5)):
        params = results[0][name]["params"]
        assert torch.isfinite(params).all()
        assert not torch.equal(params, reference)  # compression changes the numbers a little...
        # ...but not the training: the parameters moved as far as uncompressed (a hook that
        # dropped gradients would leave them where they started), and to about the same
        # place. They move little in 6 steps: a tolerance on the values alone passes
        # untrained ones.
        trained = float((params - initial).norm())
        off = float((params - reference).norm())
        assert 0.8 * moved < trained < 1.25 * moved, (name, trained, moved)
        assert off < bound * moved, (name, off, moved)
    fp16 = results[0]["fp16"]["summary"]["optimizations"]["ddp_overlap"]
    full = results[0]["overlap"]["summary"]["optimizations"]["ddp_overlap"]
    assert fp16["bytes_per_step"] * 2 == full["bytes_per_step"]  # half the bytes on the wire


@pytest.mark.slow
def test_profile_counts_buckets_and_bytes_of_the_models_gradients(results):
    model = mlp()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tiny = results[0]["tiny_buckets"]["summary"]["optimizations"]["ddp_overlap"]
    # 2.1 MB of gradients in 0.5 MB buckets: at least three buckets.
    assert tiny["bytes_per_step"] == grad_bytes == sum(tiny["bucket_bytes"])
    assert tiny["buckets_per_step"] >= 3
    one = results[0]["overlap"]["summary"]["optimizations"]["ddp_overlap"]
    assert (
        one["bytes_per_step"] == grad_bytes and one["buckets_per_step"] < tiny["buckets_per_step"]
    )
    profile = tiny["allreduce_profile"]
    # Step 0 is left out: DDP's first backward is not its steady state (see below).
    assert profile["profiled_steps"] == STEPS - 1
    calls = {row["size_class"]: row for row in profile["classes"]}
    expected: dict[str, list[int]] = {}
    for nbytes in tiny["bucket_bytes"]:
        expected.setdefault(size_class(nbytes), []).append(nbytes)
    for cls, sizes in expected.items():
        assert calls[cls]["calls"] == len(sizes) * (STEPS - 1)
        assert calls[cls]["bytes"] == sum(sizes) * (STEPS - 1)
    flat = results[0]["no_overlap"]["summary"]["optimizations"]["ddp_overlap"]
    assert flat["buckets_per_step"] == 1 and flat["bytes_per_step"] == grad_bytes


@pytest.mark.slow
def test_the_first_synchronised_step_is_one_bucket_after_backward_and_left_out(results):
    tiny = results[0]["tiny_buckets"]
    section = tiny["summary"]["optimizations"]["ddp_overlap"]
    grad_bytes = sum(p.numel() * p.element_size() for p in mlp().parameters())
    first, *later = tiny["calls"]
    # The first backward all-reduces every gradient as one bucket, started only once
    # every gradient was computed (torch 2.13)...
    assert first == [grad_bytes]
    assert set(tiny["started"][0]) == {0}
    # ...then DDP rebuilds its buckets: every later step makes the same 0.5 MB calls,
    # the profile's, which holds those steps only.
    assert all(calls == section["bucket_bytes"] for calls in later) and len(later) == STEPS - 1
    profile = section["allreduce_profile"]
    assert profile["profiled_steps"] == STEPS - 1
    assert sum(row["calls"] for row in profile["classes"]) == sum(map(len, later))
    assert sum(row["bytes"] for row in profile["classes"]) == sum(map(sum, later))
    assert "from the 2nd synchronised backward on" in profile["note"]


@pytest.mark.slow
def test_accumulation_all_reduces_only_on_the_last_micro_step(results):
    accumulated = results[0]["accumulate"]["summary"]["optimizations"]["ddp_overlap"]
    plain = results[0]["overlap"]["summary"]["optimizations"]["ddp_overlap"]
    calls = sum(row["calls"] for row in accumulated["allreduce_profile"]["classes"])
    assert (
        calls
        == accumulated["buckets_per_step"] * accumulated["allreduce_profile"]["profiled_steps"]
    )
    assert accumulated["buckets_per_step"] == plain["buckets_per_step"]
    summary = results[0]["accumulate"]["summary"]
    assert summary["samples"] == STEPS * BATCH * 2  # two ranks, two micro-batches of B/2


@pytest.mark.slow
def test_exposed_communication_is_measured_and_bounded(results):
    for name in ("overlap", "tiny_buckets", "no_overlap"):
        section = results[0][name]["summary"]["optimizations"]["ddp_overlap"]["overlap"]
        assert 0 < section["comm_exposed_s_per_step"] <= section["comm_busy_s_per_step"] + 1e-9
        assert 0.0 <= section["hidden_fraction"] <= 1.0
        steps = results[0][name]["summary"]["phases_s"]
        assert steps["comm_exposed"] > 0
    flat = results[0]["no_overlap"]["summary"]["optimizations"]["ddp_overlap"]["overlap"]
    assert flat["hidden_fraction"] == 0.0


@pytest.mark.slow
def test_small_buckets_start_all_reducing_while_backward_still_computes_gradients(results):
    tiny = results[0]["tiny_buckets"]
    gradients = len(list(mlp().parameters()))
    # Event order, not clock readings: for each gradient, in the order backward computed
    # them, how many all-reduce calls of the step had started by then. From the second
    # step on (DDP's own buckets), the first bucket starts while backward still has
    # gradients to compute: at least the first layer's weight and bias come after it.
    for started in tiny["started"][1:]:
        assert len(started) == gradients
        assert sum(1 for calls in started if calls > 0) >= 2, started
        assert started == sorted(started)
    # So the measurement reports communication hidden behind backward: busy from the
    # first call's start, exposed from the last one's.
    for name in ("tiny_buckets", "overlap"):
        section = results[0][name]["summary"]["optimizations"]["ddp_overlap"]
        assert section["buckets_per_step"] >= 2, name
        overlap = section["overlap"]
        assert overlap["comm_exposed_s_per_step"] < overlap["comm_busy_s_per_step"], name
        assert overlap["hidden_fraction"] > 0, name


@pytest.mark.slow
def test_powersgd_on_gloo_is_kept_to_one_bucket(results):
    section = results[0]["powersgd_small_buckets"]["summary"]["optimizations"]["ddp_overlap"]
    assert section["buckets_per_step"] == 1 and section["bucket_cap_mb"] > 2
    assert any("powersgd on gloo" in note for note in section["notes"])
    assert "before PowerSGD compresses them" in section["allreduce_profile"]["note"]


@pytest.mark.slow
def test_nccl_knobs_are_recorded_and_ignored_on_gloo(results):
    section = results[0]["nccl_knobs"]["summary"]["optimizations"]["ddp_overlap"]
    assert section["nccl_algo"] == "tree" and section["nccl_proto"] == "ll"
    assert any("nccl_algo=tree recorded and ignored" in note for note in section["notes"])


def test_bf16_on_gloo_and_one_rank_fail_clearly():
    ddp_cls = get_optimization("ddp_overlap")
    with pytest.raises(CombinationError, match="bf16 needs the nccl back end; gloo cannot"):
        ddp_cls(comm_hook="bf16").check(2, "cpu", "gloo")
    ddp_cls(comm_hook="bf16").check(2, "cuda", "nccl")
    with pytest.raises(CombinationError, match="needs at least 2 ranks, the run has 1"):
        ddp_cls().check(1, "cpu", "gloo")
    # tf.distribute's NCCL on CPUs: it ran its ring instead and the summary said nccl.
    with pytest.raises(CombinationError, match="implementation nccl needs GPUs; on cpu"):
        ddp_cls(implementation="nccl").check(2, "cpu", "gloo")
    ddp_cls(implementation="nccl").check(2, "cuda", "nccl")


def test_intensity_maps_onto_bucket_size_and_zero_is_the_baseline():
    ddp_cls = get_optimization("ddp_overlap")
    assert ddp_cls.resolve(0.0, {})["mode"] == "no_overlap"
    sizes = [ddp_cls.resolve(i, {})["bucket_cap_mb"] for i in (0.25, 0.5, 0.75, 1.0)]
    assert sizes == [64.0, 16.0, 4.0, 1.0]
    assert all(ddp_cls.resolve(i, {})["mode"] == "overlap" for i in (0.01, 1.0))


def test_bf16_is_rejected_before_any_rank_starts(tiny_scenario):
    result = run_cli(
        "run",
        tiny_scenario(),
        "--set",
        "world.nprocs=2",
        "--set",
        "optimizations.ddp_overlap={comm_hook: bf16}",
        timeout=60,
    )
    assert result.returncode == 2
    assert "bf16 needs the nccl back end" in result.stderr


@pytest.mark.slow
def test_cli_run_prints_the_allreduce_profile(tiny_scenario, tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "run",
        tiny_scenario(),
        "--out",
        out,
        "--set",
        "world.nprocs=2",
        "--set",
        "optimizations.ddp_overlap.intensity=0.9",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "all-reduce calls by message size" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    section = summary["optimizations"]["ddp_overlap"]
    # 2 warm-up steps, then 6 measured: the first synchronised step is a warm-up one.
    assert section["allreduce_profile"]["profiled_steps"] == 6
    assert "grad_sync" not in summary  # DDP, not the runtime's flat fallback, synced


def test_a_run_too_short_to_profile_reports_no_overlap_figures_not_zero():
    section = get_optimization("ddp_overlap")(1.0).summary()
    assert section["allreduce_profile"]["profiled_steps"] == 0
    assert section["overlap"] == {
        "comm_busy_s_per_step": None,
        "comm_exposed_s_per_step": None,
        "hidden_fraction": None,  # unmeasured, not "nothing hidden"
    }


def test_size_classes_are_named_in_the_binary_units_they_are_cut_at():
    kib, mib = 1 << 10, 1 << 20
    assert size_class(128 * kib) == "<=128KiB"
    assert size_class(128 * kib + 1) == size_class(16 * mib) == "128KiB-16MiB"
    assert size_class(64 * mib + 1) == ">64MiB"


@pytest.mark.slow
def test_a_scripts_own_backward_counts_the_all_reduce_it_waits_for_as_exposed():
    """A DDP script ported as written (its own ``loss.backward()``) under ddp_overlap,
    rank 1 reaching backward 0.2 s late every step: rank 0 waits for it in the
    all-reduce. The backward phase ended when backward reached the model's input,
    before DDP's reducer waited for its buckets (its end-of-backward callback was queued
    after the session's), so the 0.2 s landed in ``other``, the script's own time,
    and the exposed time was taken out of ``backward`` (0 s, comm_exposed 0.002 s,
    other 0.105 s with a 0.1 s delay). It is timed as with `Session.backward`."""
    from rank_programs import straggling_backward

    delay = 0.2
    ranks = launch_local(straggling_backward, 2, ["plain", "explicit"], delay)
    for way in ("plain", "explicit"):
        for phases in ranks[0][way][1:]:  # the first is DDP's bucket-rebuilding step
            assert phases["comm_exposed"] > delay / 2, (way, phases)
            assert phases["other"] < delay / 2, (way, phases)
            assert phases["backward"] > 0, (way, phases)

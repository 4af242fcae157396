"""pipeline on real gloo ranks: every schedule against the unsplit model, the 2 x 2 mesh
with DDP, per-stage checkpoints and exact resume, the partitioner, and bad settings."""

import itertools
import json
import shutil

import pytest
import torch
from rank_programs import (
    SHAPE,
    batchnorm_mlp,
    first_batch,
    pipeline_batchnorm,
    pipeline_replica_buffers,
    pipeline_runs,
    pipeline_script_mistakes,
    unequal_mlp,
    v_schedule_link_warmup,
)
from torch.distributed.pipelining import PipelineStage

from conftest import cli_here, run_cli
from overlapkit import get_optimization
from overlapkit.data import ShardedSampler, SyntheticImages
from overlapkit.launch.local import launch_local
from overlapkit.optimizations.checkpoint import fileformat
from overlapkit.optimizations.pipeline import PipelineError
from overlapkit.optimizations.pipeline.partition import LayerCost, balanced, equal_count, stage_time
from overlapkit.optimizations.pipeline.schedules import SCHEDULES
from overlapkit.runtime import CombinationError, Plan
from overlapkit.runtime.rng import seed_everything
from overlapkit.scenarios.loader import load_scenario

BATCH = 16
# The schedules this torch runs (all from 2.11, none before).
RUNNABLE = [name for name, kind in SCHEDULES.items() if not kind.missing_in(torch.__version__)]
needs_runnable_torch = pytest.mark.skipif(
    not RUNNABLE, reason=f"pipeline needs torch 2.11 (this is {torch.__version__})"
)


def config(steps=1, batch_size=BATCH, others=None, directory=None, **pipeline):
    return {
        "pipeline": pipeline,
        "steps": steps,
        "batch_size": batch_size,
        "others": others or {},
        "dir": directory,
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    if not RUNNABLE:
        pytest.skip(f"pipeline needs torch 2.11 (this is {torch.__version__})")
    root = tmp_path_factory.mktemp("pipeline")
    configs = {
        f"schedule {name}": config(schedule=name, microbatches=4, split="equal")
        for name in RUNNABLE
    }
    configs["auto"] = config(steps=8, split="auto", microbatches=4)
    configs["equal"] = config(steps=8, split="equal", microbatches=4)
    configs["prefetch"] = config(steps=3, others={"prefetch": {"workers": 0}}, split="equal")
    configs["plain"] = config(steps=3, split="equal")
    ckpt = {"checkpoint": {"every": 2, "keep": 3, "final": True}}
    configs["straight"] = config(6, others=ckpt, directory=str(root / "a"), split="equal")
    configs["first half"] = config(3, others=ckpt, directory=str(root / "b"), split="equal")
    configs["resumed"] = config(6, others=ckpt, directory=str(root / "b"), split="equal")
    results = launch_local(pipeline_runs, 2, configs)
    return results, root


def reference_step(batch):
    seed_everything(0)
    model = unequal_mlp()
    inputs, targets = batch
    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.skipif(
    not hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"),
    reason="this torch has no such warm-up (before 2.9)",
)
@pytest.mark.parametrize("schedule", [s for s in ("zbv", "dualpipev") if s in RUNNABLE])
def test_v_schedules_warm_their_links_up_on_torch_before_2_13(schedule):
    """A V schedule's middle stages share a rank; the link warm-up of torch < 2.13
    sent from one to the other, which gloo refuses ("Pair is not connected")."""
    results = launch_local(v_schedule_link_warmup, 2, schedule)
    assert results == {0: [0, 3], 1: [1, 2]}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", RUNNABLE)
def test_every_schedule_gives_the_unsplit_models_loss_and_gradients(two_ranks, schedule):
    results, _ = two_ranks
    loss, grads = reference_step(first_batch(BATCH))
    got = {}
    losses = []
    for rank_result in results.values():
        run = rank_result[f"schedule {schedule}"]
        got.update(run["grads"])
        if run["loss"] is not None:
            losses.append(run["loss"])
    assert losses == [pytest.approx(loss, rel=1e-5)]  # the last stage alone computes it
    assert got.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_auto_partition_balances_unequal_layers_better_than_equal_counts(two_ranks):
    results, _ = two_ranks
    auto = results[0]["auto"]["summary"]["optimizations"]["pipeline"]
    equal = results[0]["equal"]["summary"]["optimizations"]["pipeline"]
    assert [s["layers"] for s in equal["partition"]] == [list("01234"), list("56789")]
    assert len(auto["layer_costs"]) == 10 and auto["link_gbps"] > 0
    # Layers 2-5 are the four wide ones: equal counts put three of them on the first
    # stage; the partitioner moves the cut forward, to one or two of them (which of the
    # two is measurement noise: the stages are within ~15 % either way).
    first_stage = auto["partition"][0]["layers"]
    assert first_stage[0] == "0" and len(first_stage) in (3, 4), auto["partition"]

    # What the partitioner saw, rank 0's profile of each layer (the least disturbed of 5
    # runs): counted equally, the first stage does ~2-3x the second's work (three wide
    # layers against one and small ones); the auto split's slowest stage does less.
    compute = [c["compute_s"] for c in auto["layer_costs"]]
    assert sum(compute[:5]) > 1.5 * sum(compute[5:]), compute
    assert max(s["compute_s"] for s in auto["partition"]) < sum(compute[:5])

    # Measured: the busiest rank's compute over the idlest's (~1.2 against ~3 on an idle
    # machine; the wide gap keeps the comparison safe on a loaded one, a bound does not).
    def spread(section):
        compute = [r["forward_s"] + r["backward_s"] for r in section["measured"]["per_rank"]]
        return max(compute) / min(compute)

    assert spread(auto) < spread(equal)


@pytest.mark.slow
def test_measurements_cover_bubble_balance_and_traffic(two_ranks):
    results, _ = two_ranks
    section = results[0]["equal"]["summary"]["optimizations"]["pipeline"]
    measured = section["measured"]
    assert measured["ideal_bubble_fraction"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1), p=2 m=4
    assert 0 < measured["bubble_fraction"] < 1
    # The equal split cuts after layer 4, 768 wide: 16 samples x 768 floats sent forward
    # by rank 0, and their gradient sent back by rank 1.
    assert measured["sent_bytes_per_step"] == 2 * BATCH * 768 * 4
    assert {tuple(r["stages"]) for r in measured["per_rank"]} == {(0,), (1,)}
    phases = results[0]["equal"]["summary"]["phases_s"]
    assert phases["bubble"] > 0 and phases["backward"] > 0


@pytest.mark.slow
def test_prefetch_feeds_the_first_stage_only_and_changes_nothing(two_ranks):
    results, _ = two_ranks
    for rank, rank_result in results.items():
        notes = rank_result["prefetch"]["summary"]["optimizations"]["prefetch"]["notes"]
        assert (rank == 1) == any("takes no inputs" in n for n in notes)
        for key, value in rank_result["plain"]["params"].items():
            assert torch.equal(rank_result["prefetch"]["params"][key], value)


@pytest.mark.slow
def test_checkpoint_saves_one_shard_per_stage_and_resumes_exactly(two_ranks):
    results, root = two_ranks
    step_dirs = sorted((root / "b" / "checkpoints").glob("step-*"))
    assert step_dirs and all(
        (d / "stage000.ckpt").is_file() and (d / "stage001.ckpt").is_file() for d in step_dirs
    )
    for rank_result in results.values():
        resumed = rank_result["resumed"]["summary"]["optimizations"]["checkpoint"]
        assert resumed["resumed_from_step"] == 3
        for key, value in rank_result["straight"]["params"].items():
            assert torch.equal(rank_result["resumed"]["params"][key], value), key


# ------------------------------------------------------------- 2 x 2 mesh
@pytest.fixture(scope="module")
def mesh_results():
    if not RUNNABLE:
        pytest.skip(f"pipeline needs torch 2.11 (this is {torch.__version__})")
    ddp = {"ddp_overlap": {"bucket_cap_mb": 0.5}}
    configs = {
        "gpipe ddp": config(4, others=ddp, schedule="gpipe", microbatches=4, split="equal"),
        "1f1b ddp": config(4, others=ddp, schedule="1f1b", microbatches=4, split="equal"),
        "1f1b flat": config(4, schedule="1f1b", microbatches=4, split="equal"),
    }
    return launch_local(pipeline_runs, 4, configs)


def reference_training(steps, replicas=2):
    """The unsplit model on the union of the replicas' batches, the same optimizer."""
    seed_everything(0)
    model = unequal_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = SyntheticImages(SHAPE, num_classes=4, num_samples=512, seed=0)
    shards = [ShardedSampler(len(dataset), r, replicas).indices() for r in range(replicas)]
    for step in range(steps):
        indices = [i for shard in shards for i in shard[step * BATCH : (step + 1) * BATCH]]
        inputs, targets = torch.utils.data.default_collate([dataset[i] for i in indices])
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpipe ddp", "1f1b ddp", "1f1b flat"])
def test_two_by_two_mesh_trains_like_one_model_on_the_global_batch(mesh_results, name):
    reference = reference_training(4)
    for rank, rank_result in mesh_results.items():
        run = rank_result[name]
        assert run["data_shard"] == (rank % 2, 2)  # ranks 0, 1: stage 0; ranks 2, 3: stage 1
        for key, value in run["params"].items():
            _, layer, rest = key.split(".", 2)
            torch.testing.assert_close(value, reference[f"{layer}.{rest}"], rtol=1e-4, atol=1e-5)
    for stage_ranks in ((0, 1), (2, 3)):  # the replicas of a stage agree exactly
        a, b = (mesh_results[r][name]["params"] for r in stage_ranks)
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_the_flat_all_reduce_of_a_pipeline_runs_once_a_step_not_per_microbatch(mesh_results):
    # The schedule runs a backward per micro-batch; the gradients are synced once, when
    # forward_backward returns (4 steps of 4 micro-batches: 4 calls, not 16).
    for rank_result in mesh_results.values():
        assert rank_result["1f1b flat"]["summary"]["grad_sync"]["calls"] == 4


@pytest.mark.slow
def test_ddp_inside_a_pipeline_overlaps_only_the_last_microbatch(mesh_results):
    run = mesh_results[0]["1f1b ddp"]
    summary = run["summary"]
    ddp = summary["optimizations"]["ddp_overlap"]
    assert any("find_unused_parameters turned on" in n for n in ddp["notes"])
    assert ddp["overlap"]["comm_busy_s_per_step"] > 0
    # Each gradient of the stage is all-reduced once a step (in its 4 micro-batches'
    # last backward), not once per micro-batch.
    stage_bytes = sum(p.numel() * p.element_size() for p in run["params"].values())
    assert ddp["bytes_per_step"] == stage_bytes
    # The share of backward time in which that all-reduce can overlap: a measured
    # figure (a timing band here would be a race on 4 ranks sharing 2 cores).
    assert summary["optimizations"]["pipeline"]["measured"]["ddp_window_fraction"] > 0


# ------------------------------------------------------------- batch norm, evaluation
def batchnorm_reference(evaluate):
    """The unsplit batch-norm model, each batch run as the pipeline's 4 micro-batches
    (its loss their mean), on the batches `pipeline_batchnorm` trains on."""
    seed_everything(0)
    model = batchnorm_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = SyntheticImages(SHAPE, num_classes=4, num_samples=512, seed=0)
    order = ShardedSampler(len(dataset), 0, 1).indices()
    cross_entropy = torch.nn.functional.cross_entropy

    def train(step):
        batch = [dataset[i] for i in order[step * BATCH : (step + 1) * BATCH]]
        inputs, targets = torch.utils.data.default_collate(batch)
        optimizer.zero_grad()
        micro = zip(inputs.chunk(4), targets.chunk(4), strict=True)
        (sum(cross_entropy(model(x), y) for x, y in micro) / 4).backward()
        optimizer.step()

    def state():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    train(0)
    train(1)
    result = {"after 2 steps": state()}
    if evaluate:
        eval_set = SyntheticImages(SHAPE, num_classes=4, num_samples=40, seed=1)
        inputs, targets = torch.utils.data.default_collate([eval_set[i] for i in range(40)])
        model.eval()
        with torch.no_grad():
            outputs = model(inputs)
        model.train()
        result["evaluation"] = {
            "accuracy": (outputs.argmax(-1) == targets).float().mean().item(),
            "loss": cross_entropy(outputs, targets).item(),
        }
        train(2)
    result["end"] = state()
    return result


def assert_stages_match(results, reference, when):
    seen = set()
    for rank_result in results.values():
        for key, value in rank_result[when].items():
            name = key.removeprefix("layers.")  # a StageModule's names: layers.<layer>.<...>
            seen.add(name)
            torch.testing.assert_close(value, reference[when][name], rtol=1e-4, atol=1e-5)
    assert seen == reference[when].keys()


@pytest.mark.slow
@needs_runnable_torch
def test_batch_norm_statistics_are_those_of_the_microbatches_alone():
    """torch sets a stage up by running its forward once, in training mode: that pass
    updated the first stage's batch-norm statistics once more than its micro-batches,
    and a later stage's with uninitialised memory (NaN statistics: the pipedream
    scenario evaluated at chance, loss NaN). The stages' buffers are put back."""
    results = launch_local(pipeline_batchnorm, 2, False)
    reference = batchnorm_reference(evaluate=False)
    for rank_result in results.values():
        tracked = [v for k, v in rank_result["end"].items() if k.endswith("num_batches_tracked")]
        assert [int(t) for t in tracked] == [2 * 4]  # 2 steps of 4 micro-batches
    assert_stages_match(results, reference, "end")


@pytest.mark.slow
@needs_runnable_torch
def test_the_replicas_of_a_stage_hold_its_first_replicas_statistics():
    """The flat all-reduce gives the replicas of a stage the first one's batch-norm
    statistics; deferred to the next forward (as DDP does for a script's model), they
    never arrived under pipeline: several stages on a rank are called one by one, not
    as the list the hook was on, and torch's set-up forward at the evaluation put each
    rank's own back. The replicas then evaluated with their own statistics."""
    schedules = ["gpipe", "interleaved_1f1b"]
    results = launch_local(pipeline_replica_buffers, 4, schedules)
    for schedule in schedules:
        for stage_ranks in ((0, 1), (2, 3)):  # pp rank 0: ranks 0, 1; pp rank 1: 2, 3
            first, other = (results[r][schedule] for r in stage_ranks)
            assert first and first.keys() == other.keys()
            assert all(torch.equal(first[k], other[k]) for k in first), schedule


@pytest.mark.slow
@needs_runnable_torch
def test_evaluation_takes_batches_of_any_size_and_training_goes_on_as_before():
    """Evaluation batches larger than a training batch, and a short last one, are
    evaluated in pieces of the training batch's size (torch fixes the shapes the stages
    send at the first step: a short batch failed in the loss); the step after it trains
    as the unsplit model does, statistics included."""
    results = launch_local(pipeline_batchnorm, 2, True)
    reference = batchnorm_reference(evaluate=True)
    assert_stages_match(results, reference, "after 2 steps")
    for rank_result in results.values():
        evaluation = rank_result["evaluation"]
        assert evaluation["samples"] == 40
        assert evaluation["accuracy"] == pytest.approx(reference["evaluation"]["accuracy"])
        assert evaluation["loss"] == pytest.approx(reference["evaluation"]["loss"], rel=1e-5)
    assert_stages_match(results, reference, "end")


@pytest.mark.slow
@needs_runnable_torch
def test_a_scripts_mistakes_under_pipeline_are_errors_that_say_what_to_do():
    said = launch_local(pipeline_script_mistakes, 2)
    for rank in (0, 1):
        # A DistributedSampler over both ranks paired rank 0's inputs with rank 1's
        # targets, silently.
        sampler = said[rank]["sampler"]
        assert (
            f"reads shard {rank} of 2; under pipeline this rank must read shard 0 of 1" in sampler
        )
        assert "session.data_shard" in sampler
        # The first stage's rank went on with its activations; the last failed on a shape.
        assert "session.forward_backward(inputs, targets, loss_fn)" in said[rank]["model(x)"]
        # Outside a step (its own evaluation after training): rank 0 got its stage's
        # activations as if they were the model's outputs.
        assert "gives that stage's activations" in said[rank]["model(x) after"]
        assert "session.evaluate(loader)" in said[rank]["model(x) after"]
        # 40 samples in batches of 16: the last, 8, failed inside torch's loss call.
        assert "this batch has 8 samples, the first had 16" in said[rank]["short batch"]
        assert "drop_last=True" in said[rank]["short batch"]


# ------------------------------------------------------------- bad settings
def pipeline(**settings):
    return get_optimization("pipeline")(**settings)


def plan(world_size=2, **kwargs):
    return Plan(world_size=world_size, device="cpu", backend="gloo", **kwargs)


def test_a_schedule_newer_than_this_torch_is_refused_naming_both(monkeypatch):
    assert all(kind.missing_in("2.11.0") is None for kind in SCHEDULES.values())
    assert all(kind.missing_in("2.10.0") for kind in SCHEDULES.values())
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu126")
    with pytest.raises(
        PipelineError, match=r"zbv needs torch 2\.11 or later \(this is torch 2\.9\.1\+cu126\)"
    ):
        pipeline(schedule="zbv").check(2, "cpu", "gloo")
    with pytest.raises(PipelineError, match="gpipe needs torch 2.11"):
        pipeline(schedule="gpipe").check(2, "cpu", "gloo")


def test_too_few_layers_for_the_stages_counts_them_as_asked():
    """With several stages per rank it said 'pipeline has 4 stages' to a user who
    asked for 2."""
    from overlapkit.optimizations.pipeline.layers import SplitError

    interleaved = pipeline(stages=2, schedule="interleaved_1f1b", stages_per_rank=2, split="equal")
    with pytest.raises(SplitError, match=r"4 stages .*\(2 stages x 2 stages per rank\)"):
        interleaved._starts(["a", "b", "c"], None)


def test_a_compiled_model_is_refused_by_name():
    """A script's torch.compile'd nn.Sequential was 'cannot split OptimizedModule: it
    needs an nn.Sequential', and one with pipeline_layers() would have split its
    modules while the compiled graph never ran."""
    from overlapkit.optimizations.pipeline.layers import SplitError, sequential_layers

    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)), backend="eager")
    with pytest.raises(SplitError, match="cannot split a torch.compile'd Sequential"):
        sequential_layers(compiled)


def test_one_rank_is_refused():
    with pytest.raises(CombinationError, match="at least 2 ranks"):
        pipeline().check(1, "cpu", "gloo")


def test_more_stages_than_layers_is_refused():
    two_layers = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))  # noqa: E731
    with pytest.raises(PipelineError, match="4 stages but the model has only 2 layers"):
        pipeline(stages=4).check_plan(plan(4, build_model=two_layers))


def test_microbatches_that_do_not_divide_the_batch_are_refused():
    with pytest.raises(PipelineError, match="microbatches=3 must divide the batch of 16"):
        pipeline(microbatches=3, schedule="gpipe").check_plan(plan(batch_size=16))


def test_1f1b_with_fewer_microbatches_than_stages_is_refused():
    with pytest.raises(PipelineError, match="microbatches=2 < stages=4"):
        pipeline(stages=4, microbatches=2, schedule="1f1b").check(4, "cpu", "gloo")


def test_dualpipev_needs_a_microbatch_per_stage_of_the_v(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.13.0")  # a torch that has the schedule
    with pytest.raises(PipelineError, match="microbatches=2 < total_stages=4"):
        pipeline(microbatches=2, schedule="dualpipev").check(2, "cpu", "gloo")


def test_a_back_end_without_point_to_point_is_refused():
    with pytest.raises(PipelineError, match="the mpi back end cannot"):
        pipeline().check(2, "cpu", "mpi")


def test_ddp_settings_that_break_under_a_pipeline_are_refused():
    from overlapkit.runtime import Scheduler

    for settings, message in (
        ({"static_graph": True}, "silently diverge"),
        ({"find_unused_parameters": False}, "crashes GPipe"),
        ({}, "at least 2 replicas"),
    ):
        ddp = get_optimization("ddp_overlap")(**settings)
        world = 2 if not settings else 4
        with pytest.raises(CombinationError, match=message):
            Scheduler([pipeline(), ddp]).check(world, "cpu", "gloo")


def test_a_model_without_layers_is_refused():
    from overlapkit.models import BertClassifier

    with pytest.raises(
        PipelineError, match="needs an nn.Sequential or a model with pipeline_layers"
    ):
        pipeline().check_plan(plan(build_model=lambda: BertClassifier(100, 16, 1, 2)))


def test_intensity_maps_onto_a_microbatch_count_that_fits():
    assert pipeline(intensity=1.0).resolve_microbatches(32) == 16
    assert pipeline(intensity=0.5).resolve_microbatches(32) == 4
    # 1F1B needs at least as many as stages; 6 does not divide 16: the nearest that does.
    assert pipeline(intensity=0.25, stages=4).resolve_microbatches(16) == 4
    assert pipeline(intensity=0.75, schedule="gpipe").resolve_microbatches(12) in (6, 12)


# ------------------------------------------------------------- partitioner
def slowest(costs, starts, rate):
    ends = [*starts[1:], len(costs)]
    return max(stage_time(costs, a, b, rate) for a, b in zip(starts, ends, strict=True))


def test_the_dynamic_program_finds_the_best_contiguous_split():
    costs = [LayerCost(str(i), c, 1000, 0) for i, c in enumerate([4, 4, 1, 1, 1, 1, 4, 4])]
    assert slowest(costs, balanced(costs, 3, bytes_per_s=1e12), 1e12) == pytest.approx(8)
    assert equal_count(8, 3) == [0, 3, 6]  # stages of 9, 3, 8
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):  # against every possible split, transfer cost included
        n, stages = 7, 3
        values = torch.rand(n, generator=generator).tolist()
        sizes = torch.randint(1, 4000, (n,), generator=generator).tolist()
        costs = [
            LayerCost(str(i), v, b, 0) for i, (v, b) in enumerate(zip(values, sizes, strict=True))
        ]
        best = min(
            slowest(costs, [0, a, b], 1e4)
            for a, b in itertools.combinations(range(1, n), stages - 1)
        )
        assert slowest(costs, balanced(costs, stages, 1e4), 1e4) == pytest.approx(best)
    # A slow link makes cutting after a big activation costly: the cut moves.
    costs[1] = LayerCost("1", 4, 10_000_000, 0)
    assert balanced(costs, 2, bytes_per_s=1e6)[1] != 2


# ------------------------------------------------------------- scenarios
SHORT = ("--set", "train.steps=4", "--set", "train.warmup_steps=1", "--quiet")


@pytest.mark.slow
@needs_runnable_torch
def test_pipedream_checkfreq_scenario_checkpoints_each_stage_and_resumes(tmp_path):
    first = run_cli("run", "scenarios/pipedream-checkfreq.yaml", "--out", tmp_path, *SHORT)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    section = summary["optimizations"]["pipeline"]
    layers = [name for stage in section["partition"] for name in stage["layers"]]
    assert layers[0] == "stem" and layers[-1] == "head" and len(layers) == 10
    assert (
        section["measured"]["bubble_fraction"] > 0 and summary["eval"]["runs"][-1]["samples"] == 512
    )
    final = sorted((tmp_path / "checkpoints").glob("step-*"))[-1]
    assert {p.name for p in final.glob("stage*.ckpt")} == {"stage000.ckpt", "stage001.ckpt"}
    again = run_cli(
        "run",
        "scenarios/pipedream-checkfreq.yaml",
        "--out",
        tmp_path,
        *SHORT,
        "--set",
        "train.steps=6",
    )
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads((tmp_path / "summary.json").read_text())
    assert resumed["optimizations"]["checkpoint"]["resumed_from_step"] == 5
    # overlapkit export: the unsplit model from the stages' files, its own names (the
    # stage files say layers.layer3_0.conv1.weight), loadable with strict names. A copy
    # of the checkpoint folder alone: the names come from the ranks' files.
    alone = tmp_path / "elsewhere" / "checkpoints"
    shutil.copytree(tmp_path / "checkpoints", alone)
    exported = run_cli("export", alone, "--to", tmp_path / "model.pt", "--json")
    assert exported.returncode == 0, exported.stderr
    newest = json.loads((alone / "manifest.json").read_text())["checkpoints"][-1]["step"]
    assert json.loads(exported.stdout)["step"] == newest
    state = torch.load(tmp_path / "model.pt")
    model = load_scenario("scenarios/pipedream-checkfreq.yaml").model.build()
    model.load_state_dict(state)  # strict: every name the unsplit model's
    final = sorted(alone.glob("step-*"))[-1]
    last = fileformat.read(final / "stage001.ckpt")["model"]
    assert torch.equal(state["head.2.weight"], last["layers.head.2.weight"])
    assert torch.equal(state["layer3.0.conv1.weight"], last["layers.layer3_0.conv1.weight"])
    # A machine without a shared file system holds only its own stages: not a model.
    # The second machine's (rank 1: stage 1) moved where run --ray puts it on the driver.
    manifest = json.loads((alone / "manifest.json").read_text())
    theirs = json.loads(json.dumps(manifest))
    other = alone.parent / "nodes" / "node1" / "checkpoints"
    for mine, entry in zip(manifest["checkpoints"], theirs["checkpoints"], strict=True):
        moved = ("stage001.ckpt", "rank00001.ckpt")
        entry["files"] = {name: mine["files"].pop(name) for name in moved}
        (other / f"step-{entry['step']:08d}").mkdir(parents=True)
        for name in moved:
            shutil.move(
                alone / f"step-{entry['step']:08d}" / name, other / f"step-{entry['step']:08d}"
            )
    (alone / "manifest.json").write_text(json.dumps(manifest))
    partial = run_cli("export", alone, "--to", tmp_path / "partial.pt")
    (other / "manifest.json").write_text(json.dumps(theirs))
    assert partial.returncode == 2 and "1 of the pipeline's 2 stage files" in partial.stderr
    assert "nodes/NAME/checkpoints (run --ray leaves them there)" in partial.stderr
    assert not (tmp_path / "partial.pt").exists()
    # With the other machine's folder under nodes/, as run --ray leaves it: the model.
    spread = run_cli("export", alone.parent, "--to", tmp_path / "spread.pt")
    assert spread.returncode == 0, spread.stderr
    again = torch.load(tmp_path / "spread.pt")
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)
    # The other machine's copy one checkpoint behind (a run --ray stopped mid-copy): the
    # newest step every machine holds, the newer one skipped and said.
    *older, newest = theirs["checkpoints"]
    theirs["checkpoints"] = older
    (other / "manifest.json").write_text(json.dumps(theirs))
    behind = run_cli("export", alone.parent, "--to", tmp_path / "behind.pt", "--json")
    assert behind.returncode == 0, behind.stderr
    done = json.loads(behind.stdout)
    assert done["step"] == older[-1]["step"]
    assert f"step {newest['step']}: 1 of the pipeline's 2 stage files" in done["skipped"][0]


@pytest.mark.slow
@needs_runnable_torch
def test_pipedream_prefetch_scenario_splits_by_name_and_prefetches(tmp_path):
    result = run_cli("run", "scenarios/pipedream-prefetch.yaml", "--out", tmp_path, *SHORT)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    section = summary["optimizations"]["pipeline"]
    assert section["partition"][1]["layers"][0] == "layer3.0"
    assert section["microbatches"] == 8 and section["schedule"] == "gpipe"
    assert summary["optimizations"]["prefetch"]["feeder_depth"] > 0  # rank 0: the first stage


def test_check_refuses_a_bad_pipeline_before_starting_anything(tiny_scenario):
    path = tiny_scenario(
        """
        name: too-deep
        model: {name: resnet18, width: 8}
        data: {name: synthetic-images, shape: [3, 8, 8], num_samples: 64}
        train: {batch_size: 8}
        world: {nprocs: 12}
        optimizations:
          pipeline: {stages: 12, schedule: gpipe}
        """
    )
    result = cli_here("check", path)
    assert result.returncode != 0
    assert "12 stages but the model has only 10 layers" in result.stderr

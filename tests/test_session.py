"""The custom-loop API: same events as the built-in loop, exact save and resume."""

import copy

import pytest
import torch
from torch import nn

from overlapkit import Session
from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages
from overlapkit.runtime.rng import seed_everything


def make_parts(seed=0):
    seed_everything(seed)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dataset = SyntheticImages((3, 8, 8), num_classes=4, num_samples=40, seed=seed)
    loader = ResumableLoader(dataset, batch_size=8, sampler=ShardedSampler(len(dataset), seed=seed))
    return model, optimizer, loader


def train(session, model, optimizer, loader, total, prepare=True):
    if prepare:
        model, optimizer, loader = session.prepare(model, optimizer, loader)
    losses = []
    for inputs, targets in session.steps(total):
        with session.forward():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        session.backward(loss)
        session.optimizer_step()
        losses.append(float(loss.detach()))
    return losses


class EpochCounted:
    """A loader whose state_dict holds its epoch count, not its place in the epoch
    (airbench's CifarLoader given one)."""

    def __init__(self, batches):
        self.batches, self.epoch = batches, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        self.epoch += 1
        yield from self.batches

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]


def test_a_loader_restarting_its_epoch_after_a_resume_is_told_under_steps_too(tmp_path):
    """session.steps(n) over a loader whose state_dict holds no place in its epoch: a
    resume after batch 2 of 5 trained those 2 batches twice with no word (an epoch
    loop over the same loader says so)."""
    from overlapkit import LoopWarning

    model, optimizer, loader = make_parts()
    batches = list(loader)  # 5 a pass
    first = Session()
    model, optimizer, counted = first.prepare(model, optimizer, EpochCounted(batches))
    train(first, model, optimizer, counted, total=7, prepare=False)
    first.save(tmp_path / "ckpt")
    second = Session()
    model, optimizer, _ = make_parts()
    model, optimizer, counted = second.prepare(model, optimizer, EpochCounted(batches))
    start = second.load(tmp_path / "ckpt")
    # Its place is its own to say: "(epoch 1, batch 0)" was said.
    assert "resumed at step 7 (epoch 1, the loader's own place)" in start.describe()
    with pytest.warns(LoopWarning, match="after batch 2 of epoch 1, and the loader"):
        train(second, model, optimizer, counted, total=12, prepare=False)
    assert any(n.startswith("cannot resume exactly: the checkpoint was") for n in second.notes)


def test_a_copy_of_the_model_is_told_once_the_run_changes_it_and_a_frozen_one_never(tmp_path):
    """Unregistered copies of the model: timm's ModelEmaV2 (the copy held as .module),
    and an EMA kept by hand through ``.data`` (which
    moves no tensor version), first updated after the checkpoint at step 2, is told
    at the checkpoint at step 4 (a resume would start it again as the script made
    it). Never told: a frozen teacher (it was told at the start, as DQN's target
    network is: a resume makes it again as it was), one made under inference mode
    (its tensors have no version: the start failed), and a target network updated
    every step but registered inside a ModuleDict (checkpointed: it was told)."""
    import copy
    import warnings

    from overlapkit import LoopWarning, get_optimization

    model, optimizer, loader = make_parts()
    teacher = copy.deepcopy(model).requires_grad_(False)
    with torch.inference_mode():
        reference = copy.deepcopy(model)
    ema, target = copy.deepcopy(model), copy.deepcopy(model)

    class ModelEmaV2(nn.Module):  # timm's: the copy held as .module
        def __init__(self, model):
            super().__init__()
            self.module = copy.deepcopy(model)

        @torch.no_grad()
        def update(self, model):
            pairs = zip(self.module.state_dict().values(), model.state_dict().values(), strict=True)
            for mine, now in pairs:
                mine.copy_(mine * 0.9 + now * 0.1)

    model_ema = ModelEmaV2(model)
    session = Session([get_optimization("checkpoint")(every=2)], run_dir=tmp_path)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", LoopWarning)
        session.start(agent=nn.ModuleDict({"target": target}))
        told_before = len(said)
        for inputs, targets in session.steps(4):
            with session.forward():
                outputs = model(inputs)
                with torch.no_grad():
                    guide = teacher(inputs) + reference(inputs)
                loss = nn.functional.cross_entropy(outputs, targets)
                loss = loss + nn.functional.mse_loss(outputs, guide)
            session.backward(loss)
            session.optimizer_step()
            with torch.no_grad():
                target.load_state_dict(model.state_dict())
            model_ema.update(model)
            if session.state.step >= 2:  # the step after the checkpoint at 2
                for average, now in zip(ema.parameters(), model.parameters(), strict=True):
                    average.data.mul_(0.9).add_(now.data, alpha=0.1)
        notes = session.finish().get("notes", [])  # the checkpoint at step 4
    told = [str(w.message) for w in said if "not checkpointed" in str(w.message)]
    assert told_before == 0 and len(told) == 2, told
    # timm's, at the checkpoint at 2 (updated from the first step on); the EMA at 4.
    assert told[0].startswith("model_ema (a ModelEmaV2: a copy of the model's weights kept")
    assert told[1].startswith("ema (a Sequential: a copy of the model's weights kept apart")
    assert all(f"cannot resume exactly: {t}" in notes for t in told)


def test_a_loader_with_a_place_of_its_own_saved_at_an_epochs_end_counts_its_epochs_once(
    tmp_path,
):
    """session.steps(n), a checkpoint after an epoch's last batch, a loader that keeps
    its own place: the resumed run's epoch was one ahead of the run never stopped."""
    straight = Session()
    train(straight, *make_parts(), total=7)
    first = Session()
    train(first, *make_parts(), total=5)
    first.save(tmp_path / "ckpt")
    second = Session()
    model, optimizer, loader = second.prepare(*make_parts())
    second.load(tmp_path / "ckpt")
    train(second, model, optimizer, loader, total=7, prepare=False)
    assert second.progress() == straight.progress()
    assert straight.progress()["epoch"] == 1  # (its place in the epoch is the loader's)


def _inner_epoch(session, model, optimizer):
    ema = 0.0  # an EMA of the loss, no copy of the model: another function's `ema`
    for inputs, targets in session.steps(8):
        with session.forward():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        session.backward(loss)
        session.optimizer_step()
        ema = 0.9 * ema + 0.1 * float(loss.detach())
        if session.state.step % 2 == 1:  # a throwaway copy for an evaluation, made anew
            eval_model = copy.deepcopy(model).eval()
            with torch.no_grad():
                eval_model(inputs)


def test_copies_a_resume_makes_again_as_they_were_are_never_told(tmp_path):
    """Told as changed, or failing the run, before: a frozen copy named `ema` beside
    another function's `ema` (a float) where the checkpoint came; a copy made anew
    for each evaluation; a frozen teacher with a non-persistent NaN scratch buffer;
    a lazy module not built yet (its shapes raised) and a copy on the meta device
    (its sums raised)."""
    import warnings

    from overlapkit import LoopWarning, get_optimization

    class WithScratch(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner = copy.deepcopy(model)
            self.register_buffer("scratch", torch.full((4,), float("nan")), persistent=False)

        def state_dict(self, *args, **kwargs):  # the model's keys: a copy of its weights
            return self.inner.state_dict(*args, **kwargs)

    model, optimizer, loader = make_parts()
    ema = copy.deepcopy(model).requires_grad_(False)
    teacher = WithScratch(model).requires_grad_(False)
    lazy = nn.LazyLinear(4)
    with torch.device("meta"):
        on_meta = copy.deepcopy(model).to("meta")
    session = Session([get_optimization("checkpoint")(every=2)], run_dir=tmp_path)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", LoopWarning)
        session.start()
        _inner_epoch(session, model, optimizer)
        notes = session.finish().get("notes", [])
    told = [str(w.message) for w in said if "not checkpointed" in str(w.message)]
    assert not told and not [n for n in notes if "not checkpointed" in n], told
    assert ema is not None and teacher is not None and lazy is not None and on_meta is not None


def test_interrupted_and_resumed_run_matches_an_uninterrupted_one(tmp_path):
    # 5 batches per epoch: stopping after 7 steps is mid-epoch; dropout uses the RNG.
    straight_model, *rest = make_parts()
    straight = train(Session(), straight_model, *rest, total=12)

    first = Session()
    model, optimizer, loader = make_parts()
    before = train(first, model, optimizer, loader, total=7)
    saved = first.save(tmp_path / "ckpt")  # the checkpoint optimization's format
    assert saved == tmp_path / "ckpt" / "step-00000007"
    assert (saved / "rank00000.ckpt").is_file() and (tmp_path / "ckpt" / "manifest.json").is_file()

    seed_everything(123)  # the restored RNG state must win over whatever came before
    second = Session()
    model, optimizer, loader = make_parts(seed=0)
    model, optimizer, prepared = second.prepare(model, optimizer, loader)
    second.load(tmp_path / "ckpt")
    assert second.state.step == 7 and loader.state_dict() == {"epoch": 1, "position": 2}
    after = train(second, model, optimizer, prepared, total=12, prepare=False)

    assert before + after == straight
    for a, b in zip(model.parameters(), straight_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_registered_objects_are_saved_and_restored(tmp_path):
    class Counter:
        def __init__(self):
            self.value = 0

        def state_dict(self):
            return {"value": self.value}

        def load_state_dict(self, state):
            self.value = state["value"]

    session, counter = Session(), Counter()
    session.register_for_checkpointing("counter", counter)
    counter.value = 41
    session.save(tmp_path)
    counter.value = 0
    session.load(tmp_path)
    assert counter.value == 41


def test_steps_cycle_epochs_of_a_plain_loader_and_record_warmup():
    model = nn.Linear(4, 2)
    data = [(torch.randn(3, 4), torch.tensor([0, 1, 0]))] * 2
    session = Session(warmup_steps=2)
    model, optimizer, _ = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for inputs, targets in session.steps(5, loader=data):
        with session.forward():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        session.backward(loss)
        session.optimizer_step()
    summary = session.finish()
    assert summary["steps"] == 3 and summary["samples"] == 9
    assert [r["warmup"] for r in session.records] == [True, True, False, False, False]
    (node,) = summary["hardware"]["nodes"]  # what it ran on, for comparing machines
    assert node["ranks"] == [0] and node["cpu_cores"] >= 1 and node["torch"] == torch.__version__


def test_a_session_keeps_the_thread_count_the_script_chose():
    """A script that set one thread computes as it did: a session raising it to the
    machine's share changed its results in the last bits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        session = Session([], device="cpu")
        assert torch.get_num_threads() == 1
        session.finish()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_fp16_needs_a_gpu_and_bf16_autocasts_on_cpu():
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        Session(device="cpu", precision="fp16")
    session = Session(device="cpu", precision="bf16")
    model, _, _ = session.prepare(nn.Linear(4, 2))
    with session.forward():
        out = model(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16


def test_empty_loader_is_an_error_not_a_hang():
    session = Session()
    session.prepare(nn.Linear(2, 2), None, [])
    with pytest.raises(RuntimeError, match="yielded no batch"):
        next(iter(session.steps(3)))


def test_accumulating_half_batches_equals_full_batches():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "plugins"))
    from rank_programs import train_mlp

    full = train_mlp(1, 0, batch_size=16, steps=4, optimizations={})
    halves = train_mlp(1, 0, batch_size=8, steps=4, optimizations={}, accumulate=2)
    assert torch.allclose(full["params"], halves["params"], atol=1e-6)
    assert halves["summary"]["samples"] == full["summary"]["samples"] == 64
    assert halves["summary"]["final_loss"] == pytest.approx(full["summary"]["final_loss"], rel=1e-5)


@pytest.mark.parametrize(
    ("arguments", "error", "said"),
    [
        ({"optimizations": ["checkpoint"]}, TypeError, "pass instances, e.g. overlapkit.get_"),
        ({"policy": "fastest"}, ValueError, "policy 'fastest' is not one of free"),
        ({"precision": "fp8"}, ValueError, "precision 'fp8' is not one of fp32, bf16, fp16"),
        ({"device": "gpu"}, ValueError, "device 'gpu' is not a device: auto, cpu, cuda or cuda:N"),
        ({"warmup_steps": -5}, ValueError, "warmup_steps must be a whole number of at least 0"),
    ],
)
def test_session_arguments_that_cannot_work_say_what_is_allowed(arguments, error, said):
    with pytest.raises(error, match=said.replace("(", r"\(")):
        Session(**arguments)


def test_devices_torch_names_are_accepted():
    import numpy as np

    for device in ("cpu", torch.device("cpu")):
        Session(device=device, warmup_steps=np.int64(2)).finish()


def test_session_calls_out_of_order_say_what_to_call():
    model, optimizer, loader = make_parts()
    session = Session(device="cpu")
    with pytest.raises(RuntimeError, match=r"call session.prepare\(model, optimizer, loader\)"):
        next(iter(session.steps(3, loader)))
    with pytest.raises(ValueError, match="the optimizer holds none of the model's parameters"):
        session.prepare(model, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), loader)
    with pytest.raises(ValueError, match="steps\\(\\) takes a whole number of steps"):
        next(iter(Session(device="cpu").steps(-3)))
    # A GAN's two models and optimizers: one is prepared, the others registered.
    other, other_optimizer = nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), 0.1)
    with pytest.raises(TypeError, match="takes one model and its optimizer.*got tuple"):
        Session(device="cpu").prepare((model, other), optimizer, loader)
    with pytest.raises(TypeError, match="takes one model and its optimizer.*got list"):
        Session(device="cpu").prepare(model, [optimizer, other_optimizer], loader)
    session = Session(device="cpu")
    session.prepare(model, optimizer, loader)
    with pytest.raises(RuntimeError, match="already called.*session.start\\(netD=netD"):
        session.prepare(other, other_optimizer)


def test_a_generator_used_up_after_one_epoch_is_said_not_trained_on_silently():
    model, optimizer, loader = make_parts()
    batches = (batch for batch in list(loader)[:2])
    session = Session(device="cpu")
    model, optimizer, epochs = session.prepare(model, optimizer, batches)
    assert sum(1 for _ in epochs) == 2
    with pytest.raises(RuntimeError, match="used up after one pass"):
        sum(1 for _ in epochs)


def test_two_ranks_clip_gradients_already_averaged_as_under_ddp():
    """A script that clips gradients between backward and the optimizer step (or lets
    a grad scaler check them for infs) must see them averaged across ranks, as under
    DistributedDataParallel. With the flat all-reduce at the optimizer step, each rank
    clipped its own gradients and the port trained to other parameters."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "plugins"))
    from rank_programs import clipped_training

    from overlapkit.launch.local import launch_local

    ways = ["ddp", "plain", "explicit", "ddp_overlap", "no_overlap"]
    ranks = launch_local(clipped_training, 2, ways)
    for rank in ranks.values():
        reference = rank["ddp"]
        assert min(reference["norms"]) > 0.05  # every step clips
        for way in ways[1:]:
            assert rank[way]["norms"] == pytest.approx(reference["norms"], rel=1e-5), way
            assert torch.allclose(rank[way]["params"], reference["params"], atol=1e-6), way
    assert ranks[0]["plain"]["norms"] == ranks[1]["plain"]["norms"]  # one norm, every rank


def test_a_gans_registered_generator_is_data_parallel_on_two_ranks():
    """DCGAN on two ranks, seeded apart, the generator registered without DDP: it was
    left alone, so each rank trained its own generator from its own start (0.12 apart
    after 12 DCGAN steps), silently. It is made data-parallel as the prepared model
    is: the plain script's parameters with both models in DDP, on every rank. A
    loader read whole by every rank is noted (each epoch trained every sample twice).
    A generator the script wrapped in DDP itself, its ``.module`` registered, is left
    to DDP: it was all-reduced a second time, told it "came without" DDP."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "plugins"))
    from rank_programs import gan_on_two_ranks

    from overlapkit.launch.local import launch_local

    ways = ["ddp", "plain", "ddp_overlap", "unsharded", "session_backward", "one_optimizer"]
    ways.append("g_in_ddp")
    ranks = launch_local(gan_on_two_ranks, 2, ways)
    for rank in ranks.values():
        for way in ("plain", "ddp_overlap", "session_backward"):
            for net in ("d", "g"):
                assert torch.allclose(rank[way][net], rank["ddp"][net], atol=1e-6), (way, net)
            notes = " ".join(rank[way]["notes"])
            assert "net_g came without DistributedDataParallel" in notes
            assert "every rank reads" not in notes and "shares parameters" not in notes
        unsharded = " ".join(rank["unsharded"]["notes"])
        assert "every rank reads the whole" in unsharded
        assert "tied shares parameters with the prepared model" in unsharded
        assert "net_g came without" in " ".join(rank["one_optimizer"]["notes"])
        assert "net_g came without" not in " ".join(rank["g_in_ddp"]["notes"])
        for net in ("d", "g"):
            assert torch.allclose(rank["g_in_ddp"][net], rank["ddp"][net], atol=1e-6), net
    for way in ("plain", "session_backward", "one_optimizer"):
        assert torch.equal(ranks[0][way]["g"], ranks[1][way]["g"]), way
        # Averaged when backward returns, before the optimizer's step: a script
        # clipping them sees the same on every rank.
        assert torch.equal(ranks[0][way]["grad"], ranks[1][way]["grad"]), way


def test_a_ported_ddp_script_keeps_module_and_no_sync():
    """A script that wrapped its model in DDP keeps calling ``model.module`` and
    ``model.no_sync()`` after `prepare` unwrapped it for the flat all-reduce: the port
    trains to the script's parameters with one all-reduce per step, not one per
    micro-batch (before, both calls were an AttributeError)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "plugins"))
    from rank_programs import ddp_script_accumulating

    from overlapkit.launch.local import launch_local

    for rank in launch_local(ddp_script_accumulating, 2, 4).values():
        assert rank["port"]["model"] == "DDPView"
        assert torch.allclose(rank["port"]["params"], rank["ddp"]["params"], atol=1e-6)
        assert rank["port"]["calls"] == 4  # the micro-batches under no_sync() waited
        # Made data-parallel: said for the plain model (DDP's own was silent).
        assert not rank["port"]["noted"] and rank["plain"]["noted"]
        # A plain model accumulating under session.no_sync(): the same, once a step.
        for way, calls in (("plain", 4), ("plain_synced", 8)):
            assert rank[way]["model"] == "Sequential"
            assert torch.allclose(rank[way]["params"], rank["ddp"]["params"], atol=1e-6)
            assert rank[way]["calls"] == calls, way
        # Under ddp_overlap's own DDP, session.no_sync() is that DDP's no_sync().
        assert rank["plain_overlap"]["session_model"] == "ScriptDDP"  # a DDP (subclass)
        assert rank["overlap_flags"] == [False] * 4
        overlap = rank["plain_overlap"]["params"]
        assert torch.allclose(overlap, rank["ddp"]["params"], atol=1e-6)


@pytest.mark.parametrize("session_first", [False, True])
def test_a_script_under_mp_spawn_starting_its_own_group(tmp_path, session_first):
    """pytorch/examples' imagenet script starts its ranks with mp.spawn (no RANK in
    their environment) and its process group in the worker. A Session made after the
    group trains the ranks data-parallel; one made before it found no group and ran
    each rank alone: DDP unwrapped, nothing synced, the ranks trained apart and wrote
    one run folder as two rank 0s, with no word. That is now an error at prepare().
    The session keeps the thread count the script's ranks had."""
    import sys
    from pathlib import Path

    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).parent / "plugins"))
    from rank_programs import spawned_worker

    from conftest import free_port

    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(spawned_worker, nprocs=2, args=(init_method, session_first, str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    if session_first:
        for rank in ranks:
            assert "group of 2 ranks after overlapkit.Session()" in rank["error"]
            assert "make the Session after dist.init_process_group()" in rank["error"]
        return
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    # The script's thread count is kept: a share of the cores (1 each) computed other
    # last bits than the script (the imagenet port parted from it by 1e-8 in 3 epochs).
    assert [rank["threads"] for rank in ranks] == [2, 2]
    # With no LOCAL_RANK, each rank's place on its machine comes from the machines' host
    # names and boot ids (the global rank was taken for it: rank 1 alone on a second
    # machine got GPU 1). Here one host name, two boots: VMs cloned from one image.
    assert [rank["place"] for rank in ranks] == [(0, 1), (0, 1)]


def test_backwards_that_miss_the_hooked_output_are_still_synced():
    """The flat all-reduce (the session's, and ddp_overlap's no_overlap baseline) runs
    when any backward that changed the gradients ends: a loss on a model's second
    output, or a second backward through a part of the model, left ranks apart when
    the sync hung on the output the session hooked (clipping saw each rank's own). A
    DDP script under no_overlap gets the DDP-like model too. A model recomputing its
    segments in backward (reentrant activation checkpointing) is all-reduced once per
    step: each segment's backward is a pass of its own, and each one's end all-reduced
    the whole model (3 segments: 4 all-reduces a step)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "plugins"))
    from rank_programs import backwards_the_session_cannot_see

    from overlapkit.launch.local import launch_local

    ranks = launch_local(backwards_the_session_cannot_see, 2, 4)
    for way, result in ranks[0].items():
        if way == "no_overlap/ddp_script":
            assert result == ("DDPView", "Sequential")
            continue
        if way.startswith("all-reduces/"):
            assert result == 4, way  # one a step, 4 steps
            continue
        params, norms = result
        assert norms == ranks[1][way][1], way  # clipping saw the averaged gradients
        assert torch.equal(params, ranks[1][way][0]), way  # and the replicas agree


def test_batchnorm_statistics_are_rank_zeros_as_under_ddp():
    """DDP broadcasts rank 0's buffers before a forward that follows a training one
    (an evaluation's too); the flat all-reduce averaged them, so a port's batch-norm
    statistics (and its evaluation) parted from the DDP script's (found porting
    pytorch/examples' imagenet, and a loop validating every few steps)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "plugins"))
    from rank_programs import batchnorm_statistics

    from overlapkit.launch.local import launch_local

    ranks = launch_local(batchnorm_statistics, 2, 4)
    for rank in ranks.values():
        assert torch.equal(rank["port"], rank["ddp"])
        assert torch.equal(rank["no_overlap"], rank["ddp"])
        # Between a step's backward and the next forward each rank's statistics are its
        # own, as under DDP: an EMA of them read there (torchvision's, use_buffers=True)
        # took rank 0's on rank 1, and the port's EMA evaluation parted from the script's.
        for way in ("port", "no_overlap"):
            assert torch.equal(rank[f"{way}/ema"], rank["ddp/ema"]), way
        # An evaluation after training uses rank 0's statistics on every rank, as under
        # DDP (the port's rank 1 evaluated with its own: validation losses differed).
        for way in ("port", "no_overlap"):
            assert torch.equal(rank[f"{way}/eval"], rank["ddp/eval"]), way
    assert torch.equal(ranks[0]["ddp/eval"], ranks[1]["ddp/eval"])


def test_a_step_whose_end_failed_is_not_ended_again_by_finish():
    """A hook failing at a step's end (a plugin's on_step_end), caught by the script,
    which then calls finish(): the failed step was ended again there, firing the
    hook a second time (and raising again)."""
    from overlapkit import get_optimization

    fail = get_optimization("toy_fail")(rank=0, step=1, at="step_end")
    seed_everything(0)
    data = SyntheticImages((3, 8, 8), num_classes=4, num_samples=64, seed=0)
    session = Session([fail], progress=False)
    model, optimizer, loader = session.prepare(
        nn.Sequential(nn.Flatten(), nn.Linear(192, 4)),
        None,
        ResumableLoader(data, 16, ShardedSampler(len(data), seed=0)),
    )
    with pytest.raises(RuntimeError, match="toy failure on rank 0 at step 1"):
        for inputs, targets in session.steps(3):
            nn.functional.cross_entropy(model(inputs), targets).backward()
    summary = session.finish()
    assert summary["steps"] == 1  # step 0; step 1 never ended


@pytest.mark.parametrize("world_size", [2, 1])
def test_models_split_across_ranks_are_refused_and_data_parallel_is_unwrapped(world_size):
    """overlapkit syncs gradients as DDP does, every rank holding the whole model. On
    2 ranks, FSDP's flat shards were "made data-parallel" with that note: rank 0's
    shard broadcast over rank 1's (the model's second half a copy of its first) and
    the gradients FSDP had reduce-scattered averaged across shards, 0.87 from the FSDP
    script's parameters after 3 steps, silently (a registered generator's too). FSDP
    with its original parameters aborted gloo (a collective of another size), and
    DTensors (fully_shard, tensor parallel) failed in torch's dispatch
    ("c10d.broadcast_ does not have a sharding strategy"). Alone they trained, but a
    checkpoint of DTensors failed. Each is refused, before anything changed, on any
    number of ranks. DataParallel (one process over its GPUs) is unwrapped, as DDP is."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "plugins"))
    from rank_programs import models_split_across_ranks

    from overlapkit.launch.local import launch_local

    refused = {
        "fsdp": "is wrapped in FullyShardedDataParallel (FSDP)",
        "fsdp_orig_params": "is wrapped in FullyShardedDataParallel (FSDP)",
        "fully_shard": "is sharded by fully_shard (FSDP2)",
        "tensor_parallel": "has DTensor parameters (tensor parallel: parallelize_module)",
    }
    for rank in launch_local(models_split_across_ranks, world_size).values():
        for way, said in refused.items():
            error = rank[way]["error"]
            assert error is not None and error.startswith(f"the model {said}: "), way
            assert "overlapkit syncs gradients as DDP does" in error and "\n" not in error
            assert rank[way]["unchanged"], way
        assert rank["registered"].startswith("net_g is wrapped in FullyShardedDataParallel")
        ported = rank["data_parallel"]
        assert (ported["returned"], ported["trained"]) == ("DDPView", "Sequential")
        notes = " ".join(ported["notes"])
        assert "the model came wrapped in DataParallel: unwrapped" in notes
        assert ("came without DistributedDataParallel" in notes) == (world_size > 1)
        assert torch.allclose(ported["params"], rank["ddp"]["params"], atol=1e-6)
        assert ported["loaded"]  # the DataParallel script's checkpoint, module. keys


@pytest.mark.slow
def test_a_save_on_one_rank_only_says_which_ranks_it_waits_for(tmp_path):
    """minGPT-ddp's trainer saves its snapshot on rank 0 only; its port's natural
    `session.save()` in the same place left rank 0 waiting in the save's collectives
    for good, silently (the other ranks went on to their next all-reduce). The ranks
    meet first: one that waits too long says for which ranks, and how a script comes
    to call save on one rank only. Rank 1 arriving late, the save is still made."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "plugins"))
    from rank_programs import save_on_one_rank_first

    from overlapkit.launch.local import launch_local

    # Two sessions in one group: the second's meetings are its own (with the first's
    # names, held already in the group's store, it saved on rank 0 alone, unsaid).
    ranks = launch_local(save_on_one_rank_first, 2, str(tmp_path), 2.0, 2)
    assert len(ranks[0]["warnings"]) == 2
    for told in ranks[0]["warnings"]:
        assert "session.save() on rank 0" in told and "rank(s) [1]" in told
        assert "if rank == 0: session.save()" in told
    assert ranks[1]["warnings"] == []
    saved = str(tmp_path / "checkpoints" / "step-00000002")  # after its 2 steps
    assert ranks[0]["saved"] == ranks[1]["saved"] == saved


def test_a_rerun_without_the_checkpoint_optimization_says_its_saves_are_not_resumed(tmp_path):
    """minGPT-ddp's snapshot every few epochs, ported to session.save() in its run
    folder without the checkpoint optimization: the same command after a kill started
    over from step 0 with no word (the script's own snapshot had resumed it). It is
    said at the start; session.load() or the optimization resumes, unsaid."""
    from overlapkit import get_optimization

    first = Session(run_dir=tmp_path)
    train(first, *make_parts(), total=3)
    first.save()
    first.finish()

    again = Session(run_dir=tmp_path)
    again.prepare(*make_parts())
    assert again.start().step == 0
    (said,) = [n for n in again.notes if "holds checkpoints" in n]
    assert f"{tmp_path / 'checkpoints'} holds checkpoints (the newest at step 3" in said
    assert "session.load(" in said and "get_optimization('checkpoint')" in said

    manifest = tmp_path / "checkpoints" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text("{not json")  # a damaged manifest: said, not fatal
    damaged = Session(run_dir=tmp_path)
    damaged.prepare(*make_parts())
    assert damaged.start().step == 0
    assert any("holds checkpoints (the newest at step ?" in n for n in damaged.notes)
    damaged.finish()
    manifest.write_text(text)

    loaded = Session(run_dir=tmp_path)
    loaded.prepare(*make_parts())
    loaded.load(tmp_path / "checkpoints")
    assert loaded.start().step == 3
    resumed = Session([get_optimization("checkpoint")(0.5)], run_dir=tmp_path)
    resumed.prepare(*make_parts())
    assert resumed.start().step == 3
    for session in (loaded, resumed):
        assert not any("holds checkpoints" in n for n in session.notes)
    for session in (again, loaded, resumed):
        session.finish()


@pytest.mark.parametrize("save", ["before_evaluation", "after_evaluation", "mid_epoch"])
def test_random_draws_between_a_save_and_the_next_step_are_said(tmp_path, save):
    """minGPT-ddp's trainer saves its snapshot, then evaluates with dropout left on.
    Ported to session.save() (and session.load() on the rerun), a resume from it did
    not draw the evaluation's random numbers again: its parameters parted from the run
    never stopped (by up to 0.003 after 2 more epochs, 2 ranks), silently. At an
    epoch's end the draws may also be the epoch loop's own, which a resume makes
    again: a note says both. Inside an epoch they are the loop body's: a warning.
    Saved after the evaluation, the resume is exact and nothing is said."""
    import warnings

    from overlapkit import LoopWarning

    session = Session(run_dir=tmp_path)
    model, optimizer, loader = session.prepare(*make_parts())
    evaluation = torch.randn(8, 3, 8, 8)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(2):
            for batch, (inputs, targets) in enumerate(loader):
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(inputs), targets).backward()
                optimizer.step()
                if save == "mid_epoch" and batch == 1:
                    session.save()
                    torch.rand(1)  # the loop body's, after the save
            if save == "before_evaluation":
                session.save()
            with session.paused("evaluation"), torch.no_grad():
                model(evaluation)  # dropout still on: draws from torch's RNG
            if save == "after_evaluation":
                session.save()
    session.finish()
    told = [w for w in said if issubclass(w.category, LoopWarning)]
    notes = [n for n in session.notes if "drew random numbers" in n]
    if save == "after_evaluation":
        assert not told and not notes
    elif save == "before_evaluation":
        assert not told and len(notes) == 1
        assert "between session.save() (step-00000005) and the next step" in notes[0]
        assert "top of the epoch loop" in notes[0] and "cannot resume exactly" not in notes[0]
    else:
        (warning,) = told
        assert "between session.save() (step-00000002) and the next step" in str(warning.message)
        assert warning.filename == __file__ and len(notes) == 1


ZERO_PROGRAM = """
import json, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from conftest import free_port
from test_session import make_parts, train
from overlapkit import Session, get_optimization

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
runs = []
for total in (4, 6):  # the second resumes at step 4
    model, optimizer, loader = make_parts()
    other = nn.Linear(2, 2)
    zero = ZeroRedundancyOptimizer(other.parameters(), optimizer_class=torch.optim.Adam)
    session = Session([get_optimization("checkpoint")(every=2)], run_dir=sys.argv[1])
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    start = session.start(other=other, other_opt=zero)
    if total == 4:
        for _ in range(3):
            other(torch.ones(1, 2)).sum().backward()
            zero.step()
    train(session, model, optimizer, loader, total, prepare=False)
    session.finish()
    state = zero.optim.state_dict()["state"][0]
    runs.append([start.resumed_from, int(state["step"]), state["exp_avg"].tolist()])
dist.destroy_process_group()
print(json.dumps(runs))
"""


def test_a_registered_zero_optimizer_is_checkpointed_shard_by_shard(tmp_path):
    """A ZeroRedundancyOptimizer given to session.start() (a second model's): its
    state_dict() raised unless consolidated onto the rank, so every checkpoint failed.
    Each rank's shard is saved, and a resume restores it. (In a process of its own: a
    gloo group in the test process left later DataLoader workers hanging at fork.)"""
    import json
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-c", ZERO_PROGRAM, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tests,
        env={**__import__("os").environ, "PYTHONPATH": str(tests)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (fresh, saved_step, saved), (resumed, step, restored) = json.loads(
        result.stdout.splitlines()[-1]
    )
    assert fresh is None and resumed is not None
    assert step == saved_step == 3 and restored == saved


def test_what_a_resume_makes_again_is_not_told_and_a_sequential_lr_is_named(tmp_path):
    """Told before, wrongly: a dict of the weights built each step (for update-ratio
    logging) as kept weights; a dataset drawing from Python's random in __getitem__
    (no workers) as a draw between a resume and its first batch (it draws there in the
    run never stopped too). And the LR schedule left out was named by a SequentialLR's
    first child (registering that one left the milestones unsaved)."""
    import random
    import warnings

    from torch.utils.data import DataLoader, Dataset

    from overlapkit import LoopWarning, get_optimization

    class Drawing(Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return torch.full((4,), float(i)) * random.random(), i % 2

    def run(stop_at=None):
        seed_everything(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
        scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], [2])
        loader = DataLoader(Drawing(), batch_size=4, shuffle=True)
        session = Session([get_optimization("checkpoint")(every=3)], run_dir=tmp_path)
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        start = session.start()
        for _ in range(start.epoch, 2):
            for x, y in session.epoch(loader):
                prev = {n: p.detach().clone() for n, p in model.named_parameters()}
                with session.forward():
                    loss = nn.functional.cross_entropy(model(x), y)
                session.backward(loss)
                session.optimizer_step()
                assert prev
                if session.state.step == stop_at:
                    return session.finish().get("notes", [])
            scheduler.step()
        return session.finish().get("notes", [])

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", LoopWarning)
        run(stop_at=7)  # mid-epoch: resumed at step 6
        notes = run()
    told = [str(w.message) for w in said]
    assert not [t for t in told if "drew from" in t or "prev (" in t], told
    assert [n for n in notes if "session.start(scheduler=scheduler)" in n], notes

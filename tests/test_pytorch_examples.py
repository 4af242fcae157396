"""pytorch/examples scripts ported to the Session API (tests/plugins/pytorch_examples.py):
time_sequence_prediction (LBFGS: forward and backward run inside optimizer.step(closure)),
fast_neural_style (a transformer net trained against a frozen VGG16's features),
mnist_forward_forward, gcn, vae (noise drawn in the forward), siamese_network (random
pairs drawn in the dataset's __getitem__) and KellerJordan/cifar10-airbench's airbench94
(its own loader class, a lookahead EMA copied back into the model), pytorch/tutorials'
DQN (reinforcement_q_learning: no DataLoader, a replay memory, a target network) and
karpathy/makemore (an endless DataLoader read with next(), a while loop with a
max-steps break), seq2seq_translation_tutorial (an encoder and an attention decoder,
each its own Adam), karpathy/llm.c's train_gpt2.py (its own loader over .bin shards,
accumulation with require_backward_grad_sync, ZeroRedundancyOptimizer) and
transfer_learning_tutorial (train and val phases through one model each epoch, a
StepLR, the best weights kept and loaded back)."""

import contextlib
import pickle

import pytest
import torch
from pytorch_examples import (
    airbench94,
    char_rnn,
    dqn,
    fast_neural_style,
    forward_forward,
    gcn,
    llmc_on_two_ranks,
    makemore,
    on_two_ranks,
    seq2seq,
    siamese_network,
    synthetic_llmc_shards,
    synthetic_name_files,
    time_sequence_prediction,
    transfer_learning,
    vae,
)

from overlapkit import LoopWarning, Session, get_optimization
from overlapkit.launch.local import launch_local

Checkpoint = get_optimization("checkpoint")
Prefetch = get_optimization("prefetch")


@pytest.mark.parametrize("session_calls", [False, True])
def test_an_lbfgs_port_gives_the_scripts_losses_and_times_lbfgs_as_the_optimizer(
    fake_clock, monkeypatch, session_calls
):
    """LBFGS runs the closure (forward, backward) up to 20 times per step, its own work
    between: that work was timed as ``other``, the script's own (on 2 cores: 0.0001 s
    of optimizer in a 1.2 s step, 0.19 s of other), also with the closure's calls
    through the session. Here each of its updates takes 1 s on the fake clock."""
    import pytorch_examples

    updates = []

    class LBFGS(torch.optim.LBFGS):
        def _add_grad(self, step_size, update):
            updates.append(step_size)
            fake_clock.sleep(1.0)
            return super()._add_grad(step_size, update)

    plain = time_sequence_prediction(None, steps=2)
    monkeypatch.setattr(pytorch_examples, "LBFGS", LBFGS)
    updates.clear()
    port = time_sequence_prediction(Session(device="cpu"), steps=2, session_calls=session_calls)
    for key in ("losses", "test"):
        assert port[key] == plain[key], key
    assert torch.equal(port["params"], plain["params"])
    summary = port["summary"]
    assert summary["steps"] == 2 and len(port["losses"]) == 40  # 20 evaluations a step
    assert "optimizer steps" not in " ".join(summary.get("notes", []))
    phases = summary["phases_s"]
    assert len(updates) == 40 and phases["optimizer"] >= 20  # a step's mean
    assert phases["other"] < 1.0
    assert sum(phases.values()) == pytest.approx(summary["step_time_s"]["mean"])


def test_an_lbfgs_port_on_two_ranks_averages_every_evaluation_and_profiles_its_steps():
    """Each rank its half of the rows: every closure's backward is averaged (LBFGS reads
    the gradients at each of its 20 evaluations a step), so the replicas stay one and
    train as LBFGS on all the rows. Under ddp_overlap each backward's sync was measured
    with all of its step's all-reduces: 2 steps were reported as 39 profiled steps, its
    profile held 780 calls of the 39 made, and 99% of the communication was said hidden
    (each backward's one bucket is launched at its end: none is)."""
    whole = time_sequence_prediction(None, steps=2)
    ranks = launch_local(
        on_two_ranks, 2, "time_sequence_prediction", ["plain", "ddp_overlap"], {"steps": 2}
    )
    for way in ("plain", "ddp_overlap"):
        assert torch.equal(ranks[0][way]["params"], ranks[1][way]["params"]), way
        assert torch.allclose(ranks[0][way]["params"], whole["params"], atol=1e-8), way
        assert len(ranks[0][way]["losses"]) == 40
    assert ranks[0]["plain"]["all_reduces"] == 40  # one per evaluation
    assert not [n for n in ranks[0]["plain"]["notes"] if "every rank trains the same" in n]
    overlap = ranks[0]["ddp_overlap"]["ddp_overlap"]
    profile = overlap["allreduce_profile"]
    assert profile["profiled_steps"] == 2
    assert sum(size["calls"] for size in profile["classes"]) == 39  # from the 2nd on
    assert overlap["buckets_per_step"] == 20
    assert overlap["overlap"]["hidden_fraction"] == 0.0


def test_an_lbfgs_port_resumes_its_history_exactly(tmp_path):
    """LBFGS keeps its history (lists of tensors it appends to and pops in place) in
    its state (12 pairs after one step): a run stopped after its first step and
    resumed gives the losses and parameters of the run never stopped."""
    straight = time_sequence_prediction(Session(device="cpu"), steps=2)
    session = Session([Checkpoint(every=1)], device="cpu", run_dir=tmp_path)
    first = time_sequence_prediction(session, steps=2, stop_at=1)
    resumed = time_sequence_prediction(
        Session([Checkpoint(every=1)], device="cpu", run_dir=tmp_path), steps=2
    )
    assert first["losses"] + resumed["losses"] == straight["losses"]
    assert torch.equal(resumed["params"], straight["params"])


def test_a_frozen_loss_network_is_left_as_it_is_and_resumes_exactly(tmp_path):
    """fast_neural_style's VGG16 (requires_grad False), registered or not: the port
    gives the script's losses, the VGG is never changed, and a resume is exact."""
    plain = fast_neural_style(None)
    for register_vgg in (False, True):
        port = fast_neural_style(Session(device="cpu"), register_vgg=register_vgg)
        assert port["losses"] == plain["losses"], register_vgg
        assert torch.equal(port["params"], plain["params"]) and torch.equal(
            port["vgg"], plain["vgg"]
        )
    run = [Checkpoint(every=2, final=False)]
    first = fast_neural_style(Session(run, run_dir=tmp_path), register_vgg=True, stop_after=3)
    resumed = fast_neural_style(Session(run, run_dir=tmp_path), register_vgg=True)
    assert first["losses"][:2] + resumed["losses"] == plain["losses"]  # from step 2
    assert torch.equal(resumed["params"], plain["params"])


def test_a_frozen_loss_networks_forward_and_backward_are_timed_as_such(fake_clock, monkeypatch):
    """A registered frozen VGG (in eval mode, as perceptual losses keep it): its forwards
    and the backward through it, before the gradient reaches the prepared model's
    output, were timed as ``other``, the script's own. Here its forward and its
    backward each take 1 s on the fake clock (its input's)."""
    import pytorch_examples

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            fake_clock.sleep(1.0)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            fake_clock.sleep(1.0)
            return grad

    class SlowVgg16(pytorch_examples.Vgg16):
        def __init__(self, requires_grad=False):
            super().__init__(requires_grad)
            self.eval()

        def forward(self, X):
            return super().forward(Slow.apply(X))

    monkeypatch.setattr(pytorch_examples, "Vgg16", SlowVgg16)
    plain = fast_neural_style(None, epochs=1)
    port = fast_neural_style(Session(device="cpu"), epochs=1, register_vgg=True)
    assert port["losses"] == plain["losses"]
    summary = port["summary"]
    phases = summary["phases_s"]  # a step's mean: the VGG on y and on x, y's backward
    assert phases["forward"] >= 2.0 and phases["backward"] >= 1.0, phases
    assert phases["other"] < 0.5, phases
    assert sum(phases.values()) == pytest.approx(summary["step_time_s"]["mean"])


def test_a_registered_module_returning_its_own_parameter_is_not_hooked_step_after_step(
    tmp_path, recwarn
):
    """A registered module that returns a parameter (a learned prior, a codebook): its
    output is the same tensor every step. Hooked as an output, it gathered a hook a step,
    and an earlier step's hook said the loop fetches ahead: no final checkpoint."""
    torch.manual_seed(0)

    class Prior(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mu = torch.nn.Parameter(torch.zeros(4))

        def forward(self):
            return self.mu

    model, prior = torch.nn.Linear(4, 4), Prior()
    optimizer = torch.optim.SGD([*model.parameters(), *prior.parameters()], lr=0.1)
    session = Session([Checkpoint(every=2)], device="cpu", run_dir=tmp_path)
    model, optimizer, _ = session.prepare(model, optimizer)
    session.start(prior=prior)
    for x in session.steps(5, [torch.randn(2, 4) for _ in range(5)]):
        optimizer.zero_grad()
        (model(x).square().mean() + prior().square().sum()).backward()
        optimizer.step()
    notes = " ".join(session.finish().get("notes", []))
    assert "fetches its next batch" not in notes + " ".join(str(w.message) for w in recwarn)
    assert not prior.mu._backward_hooks
    assert "no final checkpoint" not in notes


@pytest.mark.parametrize("prepare_last", [True, False])
def test_a_forward_forward_port_trains_layer_by_layer_as_the_script_and_resumes_exactly(
    tmp_path, recwarn, prepare_last
):
    """mnist_forward_forward: each layer trained in turn by its own Adam (5 updates a
    layer a batch), no global backward. A step is a batch: 10 updates. Prepared with no
    optimizer (every layer's registered), a run stopped after its first batch took no
    step and no checkpoint, with no word (its 10 updates by registered optimizers, its
    layers' forwards called as ``layer.forward(x)``: taken for a look at one batch), and
    the same command trained that batch again; resumed after it, a false warning said
    the script skipped the batch by hand."""
    kwargs = {"samples": 96, "train_size": 32, "prepare_last": prepare_last}
    plain = forward_forward(None, **kwargs)
    port = forward_forward(Session(device="cpu"), **kwargs)
    assert port["losses"] == plain["losses"] and torch.equal(port["params"], plain["params"])
    assert port["summary"]["steps"] == 3 and len(port["losses"][0]) == 15
    run = [Checkpoint(every=1)]
    first = forward_forward(Session(run, device="cpu", run_dir=tmp_path), stop_after=1, **kwargs)
    assert first["summary"]["steps"] == 1
    resumed = forward_forward(Session(run, device="cpu", run_dir=tmp_path), **kwargs)
    assert resumed["summary"]["optimizations"]["checkpoint"]["resumed_from_step"] == 1
    assert [a + b for a, b in zip(first["losses"], resumed["losses"], strict=True)] == plain[
        "losses"
    ]
    assert torch.equal(resumed["params"], plain["params"])
    assert not [w for w in recwarn if "went by with no training forward" in str(w.message)]


def test_a_model_keeping_its_layers_in_a_plain_list_is_told_at_prepare(tmp_path):
    """mnist_forward_forward's Net keeps its layers in a plain list: nn.Module sees no
    parameter and an empty state_dict. Ported with its optimizers registered, it ran
    with no word: resumed after 2 of 3 batches its layers started afresh (0.34 off the
    run never stopped), and on 2 ranks nothing was synced."""
    run = [Checkpoint(every=1)]
    kwargs = {"samples": 96, "train_size": 32, "module_list": False, "prepare_last": False}
    with pytest.warns(LoopWarning, match=r"Net\.layers \(a list of 2 modules: use nn\.ModuleList"):
        summary = forward_forward(Session(run, run_dir=tmp_path), **kwargs)["summary"]
    assert any("checkpoints miss their weights" in note for note in summary["notes"])
    with pytest.raises(ValueError, match=r"Net\.layers"):  # the last layer's Adam, prepared
        forward_forward(Session(device="cpu"), **{**kwargs, "prepare_last": True})


def test_trainable_tensors_out_of_nn_modules_sight_are_told_at_start():
    """A plain list of nn.Parameter, or a tensor made with requires_grad=True set as an
    attribute: as with modules in a list, checkpoints missed them, silently."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.gains = [torch.nn.Parameter(torch.ones(4)) for _ in range(2)]
            self.scale = torch.ones(1, requires_grad=True)
            self.frozen = torch.ones(1)  # nothing to train: not told
            # weight_norm's `weight`, remade before each forward: a leaf once pickled
            normed = torch.nn.utils.weight_norm(torch.nn.Linear(4, 4))
            self.normed = pickle.loads(pickle.dumps(normed))

    model = Scaled()
    session = Session(device="cpu")
    model, _, _ = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(LoopWarning) as told:
        session.start()
    session.finish()
    said = " ".join(str(w.message) for w in told)
    assert "Scaled.gains (a list of 2 tensors: use nn.ParameterList)" in said
    assert "Scaled.scale (a tensor that requires grad: use nn.Parameter)" in said
    assert "frozen" not in said and "normed" not in said


def test_a_full_batch_graph_port_gives_the_scripts_epochs_and_resumes_exactly(tmp_path):
    """gcn: one forward over the whole graph an epoch (the graph the one batch of a list),
    dropout, the train and validation masks evaluated in eval mode after each update,
    inside the step: one step an epoch, the script's numbers bit for bit, a resume after
    3 of 6 epochs exact (dropout's draws included)."""
    plain = gcn(None)
    port = gcn(Session(device="cpu"))
    assert port["log"] == plain["log"] and port["test"] == plain["test"]
    assert torch.equal(port["params"], plain["params"])
    assert port["summary"]["steps"] == 6 and "notes" not in port["summary"]
    run = [Checkpoint(every=1)]
    first = gcn(Session(run, device="cpu", run_dir=tmp_path), stop_at=3)
    resumed = gcn(Session(run, device="cpu", run_dir=tmp_path))
    assert first["log"] + resumed["log"] == plain["log"] and resumed["test"] == plain["test"]
    assert torch.equal(resumed["params"], plain["params"])


def test_a_full_batch_list_on_two_ranks_is_told_that_every_rank_trains_it():
    """gcn's one batch, the whole graph, on each of 2 ranks: each step trained it twice
    (the averaged gradient one rank's) and the summary counted its samples twice, with
    no word. Sharded lists (the LBFGS port's rows by rank) are not told."""
    ranks = launch_local(on_two_ranks, 2, "gcn", ["plain"], {"epochs": 1})
    for rank in (0, 1):
        (said,) = [n for n in ranks[rank]["plain"]["notes"] if "every rank trains the same" in n]
        assert "session.data_shard" in said


def test_forward_forward_under_ddp_overlap_on_two_ranks_is_refused_not_left_to_part():
    """mnist_forward_forward calls each layer as ``layer.forward(x)``: DDP never sees a
    forward, so under ddp_overlap it averaged nothing and the replicas parted,
    silently. The first backward is now refused, naming the call; the default sync
    (overlapkit's all-reduce of any backward) keeps the replicas one."""
    from overlapkit.launch.local import RankFailedError

    with pytest.raises(RankFailedError, match="layer.forward"):
        launch_local(on_two_ranks, 2, "forward_forward", ["ddp_overlap"], {})
    ranks = launch_local(on_two_ranks, 2, "forward_forward", ["plain"], {})
    assert torch.equal(ranks[0]["plain"]["params"], ranks[1]["plain"]["params"])


def test_a_module_kept_in_a_plain_list_and_registered_is_not_told(recwarn):
    """A model keeping a second network in a plain list (out of its state_dict on
    purpose) that the script registers: checkpointed and synced as registered, so
    nothing is told (prepare said checkpoints missed its weights)."""
    import weakref

    class Holder(torch.nn.Module):
        def __init__(self, critic):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.critic = [critic]
            self.gone = [weakref.proxy(contextlib.ExitStack())]  # a dead proxy: not read

    critic = torch.nn.Linear(4, 1)
    holder = Holder(critic)
    optimizer = torch.optim.SGD([*holder.body.parameters(), *critic.parameters()], lr=0.1)
    session = Session(device="cpu")
    model, _, _ = session.prepare(holder, optimizer)
    session.start(critic=critic)
    session.finish()
    assert not [w for w in recwarn if "does not see them" in str(w.message)]


def test_a_loop_of_registered_optimizers_only_that_bypasses_the_session_is_told():
    """Forward-forward prepared with no optimizer, each layer's registered, its loop over
    its own loader (not the one prepare returned): 0 steps and no checkpoint, and
    nothing said (only the prepared optimizer's steps outside a step were counted)."""
    from overlapkit import LoopWarning

    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    batches = [torch.randn(2, 4) for _ in range(3)]
    session = Session([Checkpoint(every=1)], device="cpu")
    model, _, _ = session.prepare(torch.nn.Sequential(layer), None, batches)
    session.start(optimizer=optimizer)
    for x in batches:  # the script's own list
        optimizer.zero_grad()
        layer(x).square().mean().backward()
        optimizer.step()
    with pytest.warns(LoopWarning, match=r"no step ran through the session"):
        session.finish()


def test_a_vae_port_draws_its_noise_as_the_script_and_resumes_mid_epoch_exactly(tmp_path):
    """vae: the forward draws its noise (randn_like), the test pass after each epoch
    too (in eval mode) and so does the sample: every draw is the global RNG's. The port
    gives the script's losses, test losses, samples and parameters bit for bit, the
    phases add up to the step, the test pass is outside the steps; a run stopped in its
    2nd epoch and resumed from step 6 (after an epoch's end: its test and sample drawn,
    the next shuffle too) gives the rest exactly."""
    plain = vae(None)
    port = vae(Session(device="cpu"))
    for key in ("losses", "averages", "test"):
        assert port[key] == plain[key], key
    assert all(torch.equal(a, b) for a, b in zip(port["samples"], plain["samples"], strict=True))
    assert torch.equal(port["params"], plain["params"])
    summary = port["summary"]
    assert summary["steps"] == 10 and "notes" not in summary
    phases = summary["phases_s"]
    assert min(phases[p] for p in ("forward", "backward", "optimizer")) > 0, phases
    assert sum(phases.values()) == pytest.approx(summary["step_time_s"]["mean"])
    assert summary["outside_steps_s"]["between_epochs"] > 0  # the test pass and the sample
    run = [Checkpoint(every=3, final=False)]
    first = vae(Session(run, device="cpu", run_dir=tmp_path), stop_after=7)
    resumed = vae(Session(run, device="cpu", run_dir=tmp_path))
    assert resumed["summary"]["optimizations"]["checkpoint"]["resumed_from_step"] == 6
    assert first["losses"][:6] + resumed["losses"] == plain["losses"]
    assert first["test"] + resumed["test"] == plain["test"]
    assert torch.equal(resumed["samples"][-1], plain["samples"][-1])
    assert torch.equal(resumed["params"], plain["params"])


@pytest.mark.parametrize("accel", [False, True])
def test_a_siamese_port_draws_the_scripts_pairs_and_resumes_mid_epoch_exactly(tmp_path, accel):
    """siamese_network: each pair drawn with ``random`` in the dataset's __getitem__ (on
    this process as on a CPU, or in the one worker main.py gives an accelerator, its
    batches shuffled), Adadelta, a StepLR registered and stepped per epoch, a resnet with
    batch norm. The port is the script bit for bit (losses, test, learning rates,
    parameters, batch-norm statistics); a run stopped in its 2nd epoch resumes exactly."""
    plain = siamese_network(None, accel=accel)
    port = siamese_network(Session(device="cpu"), accel=accel)
    for key in ("losses", "test", "lrs"):
        assert port[key] == plain[key], key
    assert torch.equal(port["params"], plain["params"])
    assert torch.equal(port["buffers"], plain["buffers"])
    summary = port["summary"]
    assert summary["steps"] == 10 and "notes" not in summary
    assert sum(summary["phases_s"].values()) == pytest.approx(summary["step_time_s"]["mean"])
    run = [Checkpoint(every=1)]
    first = siamese_network(Session(run, device="cpu", run_dir=tmp_path), accel=accel, stop_after=7)
    resumed = siamese_network(Session(run, device="cpu", run_dir=tmp_path), accel=accel)
    assert first["losses"] + resumed["losses"] == plain["losses"]
    assert first["test"] + resumed["test"] == plain["test"] and resumed["lrs"] == plain["lrs"][1:]
    assert torch.equal(resumed["params"], plain["params"])
    assert torch.equal(resumed["buffers"], plain["buffers"])


def test_a_dataset_drawing_on_prefetchs_feeder_thread_is_said_to_resume_inexactly(tmp_path):
    """prefetch with no workers loads ahead on its feeder thread, in this process:
    siamese_network's __getitem__ draws its pairs with ``random`` there, so a checkpoint
    held the draws of batches loaded ahead, not yet trained, and a resume drew other
    pairs: stopped after 2 steps of 5, the resumed run's losses and parameters parted
    from the run never stopped (which is the plain script's), with no word. It is now
    said. The vae's forward draws too, but its loading does not: nothing said there,
    and its resume is exact."""

    def session(folder):
        chosen = [Prefetch(0.5, workers=0), Checkpoint(every=1)]
        return Session(chosen, device="cpu", run_dir=tmp_path / folder)

    plain = siamese_network(None, epochs=1)
    first = siamese_network(session("s"), epochs=1, stop_after=2)
    resumed = siamese_network(session("s"), epochs=1)
    said = [n for n in first["summary"]["notes"] if n.startswith("cannot resume exactly")]
    assert len(said) == 1 and "random" in said[0] and "feeder thread" in said[0], said
    assert said[0] in resumed["summary"]["notes"]
    assert first["losses"] + resumed["losses"] != plain["losses"]  # what it says
    plain = vae(None, epochs=1)
    first = vae(session("v"), epochs=1, stop_after=2)
    resumed = vae(session("v"), epochs=1)
    assert "notes" not in first["summary"] and "notes" not in resumed["summary"]
    assert first["losses"] + resumed["losses"] == plain["losses"]
    assert torch.equal(resumed["params"], plain["params"])


def test_a_vae_port_on_two_ranks_samples_through_its_models_own_method_under_ddp_overlap():
    """The vae calls ``model.decode(sample)`` after each epoch. Under ddp_overlap the
    model prepare returns is a DistributedDataParallel, which had no ``decode``: an
    AttributeError on 2 ranks (on one, ddp_overlap is off and the script ran). Both
    ways run now, and agree: the ranks (the same data, the same noise) stay one
    replica, the one-rank script's bit for bit (on 1 thread, as each rank here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = vae(None, epochs=1)
    finally:
        torch.set_num_threads(threads)
    ranks = launch_local(on_two_ranks, 2, "vae", ["plain", "ddp_overlap"], {"epochs": 1})
    for rank in (0, 1):
        for way in ("plain", "ddp_overlap"):
            assert ranks[rank][way]["losses"] == plain["losses"], (rank, way)
            assert torch.equal(ranks[rank][way]["samples"][0], plain["samples"][0])
            assert torch.equal(ranks[rank][way]["params"], plain["params"]), (rank, way)
            # The model's keys, as on one rank (they had "module." before each).
            assert ranks[rank][way]["keys"] == plain["keys"], (rank, way)
    assert ranks[0]["ddp_overlap"]["ddp_overlap"]["buckets_per_step"] > 0


def test_an_airbench_port_is_the_script_bit_for_bit_and_resumes_at_an_epochs_end_exactly(
    tmp_path,
):
    """airbench94: its own CifarLoader (whole data set as tensors, a flip drawn once, a
    crop and a randperm each epoch, no state_dict), label smoothing, whitening init from
    the data, a LambdaLR stepped per step, a lookahead EMA copied back into the model,
    TTA. The port is the script bit for bit; checkpointing with that loader is said to
    be inexact at prepare. With the loader's epoch count and images in a state_dict and
    the lookahead registered, a run stopped after epoch 2 resumes exactly."""
    plain = airbench94(None)
    port = airbench94(Session(device="cpu"))
    for key in ("losses", "validation", "tta"):
        assert port[key] == plain[key], key
    for key in ("params", "buffers"):
        assert torch.equal(port[key], plain[key]), key
    summary = port["summary"]
    assert summary["steps"] == 14 and "notes" not in summary
    assert sum(summary["phases_s"].values()) == pytest.approx(summary["step_time_s"]["mean"])
    run = [Checkpoint(every=4, final=False)]
    told = airbench94(Session(run, device="cpu", run_dir=tmp_path / "told"), stop_after=2)
    (said,) = told["summary"]["notes"]
    assert said.startswith("cannot resume exactly: the loader (CifarLoader) has no state_dict")
    first = airbench94(
        Session(run, device="cpu", run_dir=tmp_path), loader_state=True, stop_after=9
    )
    resumed = airbench94(Session(run, device="cpu", run_dir=tmp_path), loader_state=True)
    assert resumed["summary"]["optimizations"]["checkpoint"]["resumed_from_step"] == 8
    assert "notes" not in first["summary"] and "notes" not in resumed["summary"]
    assert first["losses"][:8] + resumed["losses"] == plain["losses"]
    assert first["validation"] + resumed["validation"] == plain["validation"]
    assert resumed["tta"] == plain["tta"]
    for key in ("params", "buffers"):
        assert torch.equal(resumed[key], plain[key]), key
    assert all(torch.equal(resumed["lookahead"][k], v) for k, v in plain["lookahead"].items())


def test_an_airbench_lookahead_left_unregistered_is_told_once_it_changes(tmp_path):
    """airbench's lookahead EMA (a LookaheadState holding a state dict of clones, made
    in the 2nd epoch and updated every 2 steps) left out of session.start(): a resume
    after it started ended 0.0146 off the run never stopped, silently. It is told at
    the first checkpoint after it changed, with the call that registers it."""
    run = [Checkpoint(every=2, final=False)]
    with pytest.warns(LoopWarning, match="lookahead_state .a LookaheadState: a copy"):
        port = airbench94(
            Session(run, device="cpu", run_dir=tmp_path),
            loader_state=True,
            register_lookahead=False,
        )
    (said,) = port["summary"]["notes"]
    assert said.startswith("cannot resume exactly: lookahead_state (a LookaheadState")
    assert (
        "session.start(lookahead_state=lambda: lookahead_state and lookahead_state.net_ema)" in said
    )


def test_a_loader_whose_state_dict_holds_no_place_in_its_epoch_is_said_to_restart_it(tmp_path):
    """airbench's CifarLoader given a state_dict (its epoch count, not its place in the
    epoch), as the note about a loader without one advises: a checkpoint after batch 2
    of epoch 1 resumed at that epoch's batch 0, the 2 batches trained twice, with no
    word (the run then stepped its LambdaLR past its schedule's end: an IndexError in
    the script). It is now said, as the third batch since the resume comes."""
    from overlapkit import LoopWarning

    run = [Checkpoint(every=2, final=False)]
    airbench94(Session(run, device="cpu", run_dir=tmp_path), loader_state=True, stop_after=7)
    session = Session(run, device="cpu", run_dir=tmp_path)
    with pytest.warns(LoopWarning, match="after batch 2 of epoch 1") as told:
        with pytest.raises(IndexError):
            airbench94(session, loader_state=True)
    session.finish()
    said = " ".join(str(w.message) for w in told)
    assert "StatefulCifarLoader" in said and "those 2 batches are trained twice" in said
    assert any(n.startswith("cannot resume exactly: the checkpoint was") for n in session.notes)


def test_a_dqn_port_is_the_tutorial_bit_for_bit_and_resumes_mid_episode_exactly(tmp_path):
    """reinforcement_q_learning: no DataLoader (an episode an epoch of range(50), an env
    step a step), batches random.sample'd from a replay memory (a deque of Transition
    namedtuples), epsilon from a global steps_done, a target net soft-updated every
    step, AdamW(amsgrad), clip_grad_value_, optimize_model() returning early for the
    first 15 steps (told: 187 steps, 172 updates). The port is the tutorial bit for
    bit. With the target net, the memory, steps_done and the env registered, a run
    stopped mid-episode resumes exactly, from the middle of an episode and from its
    first step; the memory's namedtuples made every checkpoint fail with a TypeError
    from Transition.__new__ in the snapshot."""
    plain = dqn(None)
    port = dqn(Session(device="cpu"))
    for key in ("losses", "durations", "steps_done"):
        assert port[key] == plain[key], key
    for key in ("params", "target"):
        assert torch.equal(port[key], plain[key]), key
    assert plain["durations"] == [24, 12, 50, 24, 20, 23, 21, 13]  # the third truncated
    (said,) = port["summary"]["notes"]
    assert said.startswith("187 steps and 172 optimizer steps")
    for stop, every, resumed_at in ((70, 30, 60), (30, 24, 24)):  # batch 24 of episode 2; 0 of 1
        run = [Checkpoint(every=every, final=False)]
        first = dqn(Session(run, device="cpu", run_dir=tmp_path / str(stop)), stop_after=stop)
        resumed = dqn(Session(run, device="cpu", run_dir=tmp_path / str(stop)))
        assert resumed["summary"]["optimizations"]["checkpoint"]["resumed_from_step"] == resumed_at
        updates = resumed_at - 15  # before the checkpoint
        assert first["losses"][:updates] + resumed["losses"] == plain["losses"], stop
        assert resumed["durations"] == plain["durations"], stop
        for key in ("params", "target"):
            assert torch.equal(resumed[key], plain[key]), (stop, key)
        notes = first["summary"]["notes"] + resumed["summary"].get("notes", [])
        assert not [n for n in notes if n.startswith("cannot resume")], notes


def test_a_dqn_target_network_left_unregistered_is_told(tmp_path):
    """DQN's target net is a second copy of the model that the loop soft-updates from
    it every step. Left out of session.start(), a resume started it again as the
    script made it (the first policy net's copy): resumed after 60 of 187 steps, the
    policy net ended 3.9e-05 off the run never stopped, with no word. It is now said
    at the start, as for an AveragedModel."""
    run = [Checkpoint(every=30, final=False)]
    kwargs = {"register": ("memory", "steps_done", "env")}
    plain = dqn(None)
    with pytest.warns(
        LoopWarning, match=r"target_net \(a DQN: a copy of the model's weights kept apart"
    ):
        first = dqn(Session(run, device="cpu", run_dir=tmp_path), stop_after=70, **kwargs)
    with pytest.warns(LoopWarning, match="session.start\\(target_net=target_net\\)"):
        resumed = dqn(Session(run, device="cpu", run_dir=tmp_path), **kwargs)
    said = [n for n in first["summary"]["notes"] if n.startswith("cannot resume exactly")]
    assert len(said) == 1 and "target_net" in said[0], said
    assert said[0] in resumed["summary"]["notes"]
    assert not torch.equal(resumed["params"], plain["params"])  # what it says


def test_a_makemore_port_is_the_script_bit_for_bit_and_resumes_its_endless_loader_exactly(
    tmp_path,
):
    """makemore: an InfiniteDataLoader (a RandomSampler with replacement, 1e10 samples,
    one pass read with next()), AdamW, a while loop breaking at max_steps, an evaluation
    every 6 steps over fresh shuffled DataLoaders (global draws) saving the best model's
    state_dict. Its DataLoader prepared before InfiniteDataLoader iterates it, the port
    is the script bit for bit; a run stopped after step 9 resumes from step 8 exactly:
    the sampler has no position, but its pass is replayed from its seed and the 8
    batches skipped (also with 2 workers, and 100,000 batches skip in 0.3 s, by hand)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on 2, its first run in a process parted at step 11 in 1 of 10
    try:
        _makemore_ported_and_resumed(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _makemore_ported_and_resumed(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "resumed").mkdir()
    plain = makemore(None, work_dir=tmp_path / "plain")
    port = makemore(Session(device="cpu"))
    for key in ("losses", "evaluations", "best_loss"):
        assert port[key] == plain[key], key
    assert torch.equal(port["params"], plain["params"])
    summary = port["summary"]
    assert summary["steps"] == 16 and "notes" not in summary
    assert sum(summary["phases_s"].values()) == pytest.approx(summary["step_time_s"]["mean"])
    assert summary["outside_steps_s"]["evaluation"] > 0
    run = [Checkpoint(every=4, final=False)]
    first = makemore(Session(run, device="cpu", run_dir=tmp_path), stop_after=9)
    resumed = makemore(Session(run, device="cpu", run_dir=tmp_path), work_dir=tmp_path / "resumed")
    assert resumed["summary"]["optimizations"]["checkpoint"]["resumed_from_step"] == 8
    assert "notes" not in first["summary"] and "notes" not in resumed["summary"]
    assert first["losses"][:8] + resumed["losses"] == plain["losses"]
    assert first["evaluations"][:1] + resumed["evaluations"] == plain["evaluations"]
    assert resumed["best_loss"] == plain["best_loss"]
    assert torch.equal(resumed["params"], plain["params"])
    best = [torch.load(tmp_path / way / "model.pt") for way in ("plain", "resumed")]
    assert all(torch.equal(best[0][k], v) for k, v in best[1].items())


def test_a_makemore_port_preparing_its_loader_after_iter_or_not_at_all_is_told(tmp_path):
    """The port that keeps InfiniteDataLoader as it is, then prepares its DataLoader and
    hands it the loader prepare returns (``batch_loader.data_iter = iter(loader)``), drew
    the workers' base seed twice: the script's iterator's, then the prepared loader's, so
    its batches were others than the script's from the first step (a loss of 2.81 for
    2.71, the parameters 0.0098 apart after 16 steps), with no word. prepare now says
    so. The InfiniteDataLoader itself given to prepare hands its batches out with its
    own next(), past the session: told at the first optimizer step and at the end; at
    prepare, with checkpointing on, the note said a resume would start its epoch again
    at batch 0 (there is none: no checkpoint is taken). It says it is not iterable."""
    plain = makemore(None)
    with pytest.warns(LoopWarning, match="iterated before it, no batch taken yet"):
        after = makemore(Session(device="cpu"), port="after")
    (said,) = after["summary"]["notes"]
    assert "InfiniteDataLoader" in said and "Prepare the DataLoader before" in said
    assert after["losses"][0] != plain["losses"][0]  # what it says
    run = [Checkpoint(every=4)]
    with pytest.warns(LoopWarning, match="no step ran through the session") as told:
        whole = makemore(Session(run, device="cpu", run_dir=tmp_path), port="whole")
    assert any("optimizer.step() ran outside any step" in str(w.message) for w in told)
    assert whole["summary"]["steps"] == 0 and whole["losses"] == plain["losses"]
    # At prepare, with checkpointing on: it said a resume would start the epoch again.
    (said,) = whole["summary"]["notes"]
    assert said.startswith("cannot resume exactly: the loader (InfiniteDataLoader) is not")
    assert not list((tmp_path / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_an_llmc_port_on_two_ranks_is_the_ddp_script_bit_for_bit(tmp_path, zero_stage):
    """llm.c's train_gpt2.py on 2 ranks (its DDP, 2 micro-steps a step with
    require_backward_grad_sync off but for the last, clip_grad_norm_, a cosine lr set
    by hand; ``--zero_stage 1``: ZeroRedundancyOptimizer, each rank stepping its shard
    of AdamW's state): the port, its DistributedDataLoader read through `LoaderSteps`,
    gives the script's losses, norms, val losses and parameters on each rank."""
    synthetic_llmc_shards(tmp_path)
    ranks = launch_local(
        llmc_on_two_ranks, 2, str(tmp_path), ["script", "plain"], {"zero_stage": zero_stage}
    )
    for rank in (0, 1):
        script, port = ranks[rank]["script"], ranks[rank]["plain"]
        for key in ("losses", "norms", "lrs", "val"):
            assert port[key] == script[key], (rank, key)
        assert len(port["losses"]) == 6 and len(port["val"]) == 4
        assert torch.equal(port["params"], script["params"]), rank
        assert torch.equal(port["params"], ranks[0]["script"]["params"])
        assert [n for n in port["notes"] if "cannot" in n] == []


def test_an_llmc_port_with_zero_resumes_each_ranks_optimizer_shard_exactly(tmp_path):
    """ZeroRedundancyOptimizer's state_dict() raises on a rank its state was not
    consolidated onto: every checkpoint of the ``--zero_stage 1`` port failed with
    torch's RuntimeError (calling consolidate_state_dict(to=1) as it says, on every
    rank, left rank 0's failing). Each rank now saves its own shard: stopped after 3
    steps (checkpointed at 2) and resumed, the run gives the rest of the script's
    losses, val losses and parameters, the loader's place (a shard boundary passed)
    and AdamW's moments restored."""
    synthetic_llmc_shards(tmp_path)
    ranks = launch_local(
        llmc_on_two_ranks, 2, str(tmp_path), ["script", "first", "resumed"], {"zero_stage": 1}
    )
    for rank in (0, 1):
        script, first, resumed = (ranks[rank][w] for w in ("script", "first", "resumed"))
        assert resumed["resumed_from_step"] == 2
        assert first["losses"][:2] + resumed["losses"] == script["losses"], rank
        assert first["val"] + resumed["val"][1:] == script["val"], rank  # step 2's again
        assert torch.equal(resumed["params"], script["params"]), rank


@pytest.mark.parametrize("prepare", ["encoder", "decoder"])
def test_a_seq2seq_port_is_the_tutorial_bit_for_bit_and_resumes_mid_epoch_exactly(
    tmp_path, monkeypatch, prepare
):
    """seq2seq_translation_tutorial: an EncoderRNN and an AttnDecoderRNN, each its own
    Adam, one backward through both, encoder_optimizer.step() then
    decoder_optimizer.step(); a RandomSampler DataLoader over a TensorDataset (21 of
    48 synthetic pairs kept by filterPairs: 3 batches an epoch), dropout in both
    modules, greedy evaluate() after training. One module prepared with its optimizer
    (either), the other pair given to session.start(): the port is the tutorial bit
    for bit, both modules' forwards are timed as forward (evaluate()'s after it as the
    script's own); a run stopped in its 2nd epoch resumes from step 4 exactly."""
    import pytorch_examples

    plain = seq2seq(None)
    session = Session(device="cpu")
    phases = []

    def timed(cls):
        def forward(self, *args, **kwargs):
            phases.append(session.state.clock.current)
            return cls.forward(self, *args, **kwargs)

        return type(cls.__name__, (cls,), {"forward": forward})

    for name in ("EncoderRNN", "AttnDecoderRNN"):
        monkeypatch.setattr(pytorch_examples, name, timed(getattr(pytorch_examples, name)))
    port = seq2seq(session, prepare=prepare)
    monkeypatch.undo()
    for key in ("losses", "averages", "decoded"):
        assert port[key] == plain[key], key
    for key in ("encoder", "decoder"):
        assert torch.equal(port[key], plain[key]), key
    assert plain["pairs"] == 21 and len(plain["losses"]) == 9
    assert "notes" not in port["summary"]
    assert phases == ["forward"] * 2 * 9 + ["other"] * 2 * 21, phases  # evaluate() after
    run = [Checkpoint(every=2, final=False)]
    first = seq2seq(Session(run, device="cpu", run_dir=tmp_path), prepare=prepare, stop_after=5)
    resumed = seq2seq(Session(run, device="cpu", run_dir=tmp_path), prepare=prepare)
    assert resumed["summary"]["optimizations"]["checkpoint"]["resumed_from_step"] == 4
    assert first["losses"][:4] + resumed["losses"] == plain["losses"]
    assert resumed["decoded"] == plain["decoded"]
    for key in ("encoder", "decoder"):
        assert torch.equal(resumed[key], plain[key]), key
    assert "notes" not in first["summary"] and "notes" not in resumed["summary"]


@pytest.mark.parametrize(
    ("register", "told"),
    [
        ((), r"decoder_optimizer \(an optimizer\) and decoder \(the module"),
        (("model",), r"decoder_optimizer \(an optimizer\) not"),
        (("optimizer",), r"decoder \(the module decoder_optimizer trains\) not"),
    ],
)
def test_a_seq2seq_decoder_or_its_optimizer_left_unregistered_is_told(tmp_path, register, told):
    """The encoder prepared, the decoder and its Adam (or one of them) left out of
    session.start(): checkpoints were taken all the same, and a resume started the
    decoder (or its Adam's moments) again as the script made them: after 9 steps the
    decoder ended 0.0095 off (0.0054, 0.0059) with no word. It is now said at the
    start, with the call that registers what is left out."""
    plain = seq2seq(None)
    run = [Checkpoint(every=2, final=False)]
    with pytest.warns(LoopWarning, match=told):
        first = seq2seq(
            Session(run, device="cpu", run_dir=tmp_path), register=register, stop_after=5
        )
    with pytest.warns(LoopWarning, match=told):
        resumed = seq2seq(Session(run, device="cpu", run_dir=tmp_path), register=register)
    said = [n for n in first["summary"]["notes"] if n.startswith("cannot resume exactly")]
    assert len(said) == 1 and "session.start(" in said[0], said
    assert not torch.equal(resumed["decoder"], plain["decoder"])  # what it says


def test_a_char_rnn_port_is_the_tutorial_bit_for_bit_and_resumes_mid_epoch_exactly(tmp_path):
    """char_rnn_classification_tutorial's train(): no DataLoader, each epoch the
    indices random.shuffle'd and np.array_split into minibatches (34 of 40 synthetic
    names after random_split: 4 an epoch, of 9, 9, 8, 8), one forward per name, the
    losses summed, one backward, clip_grad_norm_, SGD. Ported with range(n_batches) as
    the loader (a step indexes the epoch's own list): the tutorial bit for bit. A run
    stopped in its 2nd epoch resumes from step 6 exactly when the epoch's minibatches
    are given to session.start(); left out, the resumed epoch shuffles again from the
    RNG as it was at the checkpoint (after that epoch's shuffle): other minibatches,
    with no word. That draw before the first batch after the resume is now told."""
    synthetic_name_files(tmp_path)
    plain = char_rnn(None, tmp_path)
    port = char_rnn(Session(device="cpu"), tmp_path)
    assert plain["sizes"] == (34, 6) and len(plain["losses"]) == 12
    for key in ("losses", "averages"):
        assert port[key] == plain[key], key
    for key in ("params", "confusion"):
        assert torch.equal(port[key], plain[key]), key
    assert "notes" not in port["summary"]
    run = [Checkpoint(every=3, final=False)]
    for register in (("batches",), ()):
        run_dir = tmp_path / f"run{len(register)}"
        first = char_rnn(
            Session(run, device="cpu", run_dir=run_dir), tmp_path, register=register, stop_after=7
        )
        resumed = char_rnn(Session(run, device="cpu", run_dir=run_dir), tmp_path, register=register)
        assert resumed["summary"]["optimizations"]["checkpoint"]["resumed_from_step"] == 6
        exact = first["losses"][:6] + resumed["losses"] == plain["losses"]
        assert exact == bool(register), register
        assert torch.equal(resumed["params"], plain["params"]) == bool(register), register
        assert "notes" not in first["summary"]
        if register:
            assert "notes" not in resumed["summary"]
            continue
        # Left out: what it says (it was said nowhere).
        (said,) = resumed["summary"]["notes"]
        assert said.startswith("cannot resume exactly: the script drew from Python's random")
        assert "before batch 2 of epoch 1 was asked for" in said


def test_a_char_rnn_list_of_minibatches_not_prepared_is_told_after_a_resume(tmp_path):
    """The epoch's list of minibatches iterated through session.epoch(batches), no
    loader prepared: a plain run is the tutorial's, but a resume mid-epoch (after batch
    2 of epoch 1) started that list at its first batch again, its 2 batches before the
    checkpoint trained twice (8 minibatches where 6 were left), with no word. Now said."""
    synthetic_name_files(tmp_path)
    plain = char_rnn(None, tmp_path)
    assert char_rnn(Session(device="cpu"), tmp_path, way="epoch")["losses"] == plain["losses"]
    run = [Checkpoint(every=3, final=False)]
    session = Session(run, device="cpu", run_dir=tmp_path)
    char_rnn(session, tmp_path, way="epoch", stop_after=7)
    with pytest.warns(LoopWarning, match="trained twice"):
        resumed = char_rnn(Session(run, device="cpu", run_dir=tmp_path), tmp_path, way="epoch")
    assert len(resumed["losses"]) == 8  # what it says
    said = [n for n in resumed["summary"]["notes"] if n.startswith("cannot resume exactly")]
    assert len(said) == 1 and "after batch 2 of epoch 1" in said[0], said


@pytest.mark.parametrize("keep", ["file", "copy"])
def test_a_transfer_learning_port_is_the_tutorial_bit_for_bit_and_resumes_mid_epoch_exactly(
    tmp_path, keep
):
    """transfer_learning_tutorial's train_model: each epoch a train phase (the prepared,
    shuffled loader) and a val phase through the same model in eval mode under
    set_grad_enabled(False), StepLR stepped after the train phase, the best val
    accuracy's weights kept (torch.save to a temporary file, or a deepcopy of the state
    dict) and loaded back at the end. The port gives the tutorial's losses, each
    phase's loss and accuracy and the final (best, epoch 0's) parameters bit for bit;
    the val forwards are no steps (12 steps, 4 a phase) and no step's forward, their
    time between epochs. With the schedule, best_acc and the best weights registered,
    a run stopped in its 2nd epoch resumes from step 5 exactly: the lr, the history
    after it (the interrupted epoch's train figures are of the batches it trained),
    the best weights loaded at the end."""
    plain = transfer_learning(None, keep=keep)
    port = transfer_learning(Session(device="cpu"), keep=keep)
    for key in ("losses", "history", "best_acc", "lr"):
        assert port[key] == plain[key], key
    assert torch.equal(port["params"], plain["params"])
    assert plain["best_acc"] == 0.5 and plain["lr"] == pytest.approx(1e-4)
    summary = port["summary"]
    assert summary["steps"] == 12 and "notes" not in summary
    phases = summary["phases_s"]
    assert min(phases[p] for p in ("forward", "backward", "optimizer")) > 0, phases
    assert sum(phases.values()) == pytest.approx(summary["step_time_s"]["mean"])
    assert summary["outside_steps_s"]["between_epochs"] > 0  # the val phases
    run = [Checkpoint(every=5, final=False)]
    first = transfer_learning(Session(run, device="cpu", run_dir=tmp_path), keep=keep, stop_after=6)
    resumed = transfer_learning(Session(run, device="cpu", run_dir=tmp_path), keep=keep)
    assert resumed["summary"]["optimizations"]["checkpoint"]["resumed_from_step"] == 5
    assert first["losses"][:5] + resumed["losses"] == plain["losses"]
    assert (
        resumed["history"][:2] + resumed["history"][3:]
        == plain["history"][:2] + plain["history"][3:]
    )
    assert (resumed["best_acc"], resumed["lr"]) == (plain["best_acc"], plain["lr"])
    assert torch.equal(resumed["params"], plain["params"])
    assert "notes" not in first["summary"] and "notes" not in resumed["summary"]


def test_a_transfer_learning_schedule_left_out_is_told_its_best_weights_are_not(tmp_path):
    """The StepLR left out of session.start() is told at the start (a LoopWarning and a
    note: a resume would start its count again). The best weights and best_acc left
    out are not when the weights are kept in a file, which overlapkit cannot see (in a
    plain dict they now are, told below), so a resume after epoch 0's val phase started
    best_acc at 0.0 and the best weights as the script made them, and loaded epoch 1's
    at the end: 0.0086 off the run never stopped, silently (the README says what to
    register)."""
    plain = transfer_learning(None)
    run = [Checkpoint(every=5, final=False)]
    with pytest.warns(LoopWarning, match="the optimizer's LR schedule is not checkpointed"):
        first = transfer_learning(
            Session(run, device="cpu", run_dir=tmp_path), register=(), stop_after=6
        )
    said = [n for n in first["summary"]["notes"] if n.startswith("cannot resume exactly")]
    # By the name train_model gives it (it said lr_scheduler=lr_scheduler).
    assert len(said) == 1 and "session.start(scheduler=scheduler)" in said[0], said
    register = ("exp_lr_scheduler",)
    resumed = transfer_learning(
        Session(run, device="cpu", run_dir=tmp_path / "b"), register=register, stop_after=6
    )
    resumed = transfer_learning(
        Session(run, device="cpu", run_dir=tmp_path / "b"), register=register
    )
    assert "notes" not in resumed["summary"]  # not told
    assert not torch.equal(resumed["params"], plain["params"])  # what it is not told
    # Kept in a plain dict (the tutorial's older versions): told, at the first
    # checkpoint after it was bound anew to weights no module holds (it was not).
    kept = Session(run, device="cpu", run_dir=tmp_path / "c")
    kept = transfer_learning(kept, keep="copy", register=register, stop_after=6)
    said = [n for n in kept["summary"]["notes"] if "best_model_wts" in n]
    assert len(said) == 1 and "session.start(best_model_wts=lambda: best_model_wts)" in said[0]

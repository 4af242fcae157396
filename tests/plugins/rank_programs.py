"""Functions the tests run inside ranks (importable by spawned processes)."""

from __future__ import annotations

import contextlib
import socket
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from overlapkit import Optimization, Session, get_optimization
from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages
from overlapkit.runtime.distributed import init_world
from overlapkit.runtime.rng import seed_everything

SHAPE = (3, 8, 8)


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(192, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, 4),
    )


def seeded_mlp_and_shard(
    rank: int, world_size: int, num_samples: int, batch_size: int
) -> tuple[nn.Module, ResumableLoader]:
    """Seed 0, the MLP, and this rank's shard of the synthetic images, in batches."""
    seed_everything(0)
    model = mlp()
    dataset = SyntheticImages(SHAPE, num_classes=4, num_samples=num_samples, seed=0)
    sampler = ShardedSampler(len(dataset), rank, world_size, seed=0)
    return model, ResumableLoader(dataset, batch_size, sampler)


def sigint_held() -> bool:
    """Whether SIGINT is still blocked when a rank's function starts."""
    import signal

    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def fit(
    session: Session, model: nn.Module, steps: int, after_backward: Any = None
) -> dict[str, Any]:
    """Train ``steps`` steps on cross-entropy; return the session's summary."""
    for inputs, targets in session.steps(steps):
        with session.forward():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        session.backward(loss)
        if after_backward is not None:
            after_backward()
        session.optimizer_step()
    return session.finish()


def train_mlp(
    world_size: int,
    rank: int,
    batch_size: int,
    steps: int,
    optimizations: dict[str, dict[str, Any]],
    accumulate: int = 1,
    warmup_steps: int = 0,
    record_calls: bool = False,
) -> dict[str, Any]:
    """Train the MLP on this rank's shard; return final parameters and the summary.

    ``record_calls``: also return ddp_overlap's all-reduce calls of each step, ``calls``
    (their bytes, in launch order), and ``started``: for each gradient, in the order they
    were computed, how many of the step's calls had started by then (event order, not
    clock readings)."""
    model, loader = seeded_mlp_and_shard(rank, world_size, 512, batch_size)
    built = []
    for name, settings in optimizations.items():
        settings = dict(settings)
        built.append(get_optimization(name)(settings.pop("intensity", 1.0), **settings))
    session = Session(built, device="cpu", accumulate=accumulate, warmup_steps=warmup_steps)
    model, optimizer, _ = session.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader
    )
    raw = model.module if hasattr(model, "module") else model
    calls: dict[str, list[list[int]]] = {"calls": [], "started": []}
    after_backward = None
    if record_calls:
        (ddp,) = [o for o in built if o.name == "ddp_overlap"]
        started: list[int] = []
        for param in raw.parameters():
            param.register_post_accumulate_grad_hook(
                lambda _: started.append(len(ddp._timer.calls))  # the step's calls so far
            )

        def after_backward() -> None:
            calls["calls"].append([call.nbytes for call in ddp._timer.calls])
            calls["started"].append(started.copy())
            started.clear()

    summary = fit(session, model, steps, after_backward)
    params = torch.cat([p.detach().reshape(-1) for p in raw.parameters()])
    return {"params": params, "summary": summary, **(calls if record_calls else {})}


def clipped_training(ways: list[str], steps: int = 5) -> dict[str, dict[str, Any]]:
    """In one 2-rank group, train the MLP clipping gradients between backward and the
    optimizer step, once per way: ``ddp`` (the plain script, DistributedDataParallel),
    ``plain`` (its port, the script's own calls), ``explicit`` (`Session.backward` and
    `optimizer_step`), ``ddp_overlap`` and its ``no_overlap`` baseline. Returns each way's final parameters and the
    gradient norms the script saw before clipping, one per step."""
    world = init_world("cpu", "gloo")
    results = {}
    try:
        for way in ways:
            model, loader = seeded_mlp_and_shard(world.rank, world.world_size, 256, 16)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            session = None
            if way == "ddp":
                model = nn.parallel.DistributedDataParallel(model)
            else:
                intensity = {"ddp_overlap": 1.0, "no_overlap": 0.0}  # 0: its flat baseline
                chosen = (
                    [get_optimization("ddp_overlap")(intensity[way])] if way in intensity else []
                )
                session = Session(chosen, device="cpu")
                model, optimizer, loader = session.prepare(model, optimizer, loader)
            norms = []
            batches = iter(loader)
            for _ in range(steps):
                inputs, targets = next(batches)
                optimizer.zero_grad()
                if way == "explicit":
                    with session.forward():
                        loss = nn.functional.cross_entropy(model(inputs), targets)
                    session.backward(loss)
                else:
                    nn.functional.cross_entropy(model(inputs), targets).backward()
                norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
                if way == "explicit":
                    session.optimizer_step()
                else:
                    optimizer.step()
            if session is not None:
                batches.close()  # the step loop ends here, not at the loader's end
                session.finish()
            raw = model.module if hasattr(model, "module") else model
            params = torch.cat([p.detach().reshape(-1) for p in raw.parameters()])
            results[way] = {"params": params, "norms": norms}
        return results
    finally:
        torch.distributed.destroy_process_group()


def ddp_script_accumulating(steps: int = 4) -> dict[str, dict[str, Any]]:
    """In one 2-rank group, a DDP script that accumulates two micro-batches per step
    under ``model.no_sync()``, clips, and reads ``model.module``: as written (``ddp``)
    and ported (``port``: the same lines after `Session.prepare`); and a script with a
    plain model accumulating under ``session.no_sync()`` (``plain``) and without it
    (``plain_synced``). Returns each one's final parameters, the type of the model it
    trained and, for the ports, the flat all-reduce's calls."""
    world = init_world("cpu", "gloo")
    results: dict[str, dict[str, Any]] = {}
    try:
        for way in ("ddp", "port", "plain", "plain_synced", "plain_overlap"):
            plain = way.startswith("plain")
            model, loader = seeded_mlp_and_shard(world.rank, world.world_size, 256, 8)
            model = model if plain else nn.parallel.DistributedDataParallel(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            overlap = [get_optimization("ddp_overlap")(1.0)] if way == "plain_overlap" else []
            session = Session(overlap, device="cpu") if way != "ddp" else None
            if session is not None:
                model, optimizer, loader = session.prepare(model, optimizer, loader)
            batches = iter(loader)
            for _ in range(steps):
                optimizer.zero_grad()
                if way in ("plain", "plain_overlap"):
                    waiting = session.no_sync()
                elif way == "plain_synced":
                    waiting = contextlib.nullcontext()
                else:
                    waiting = model.no_sync()
                with waiting:
                    if way == "plain_overlap":  # DDP's own flag, inside the block
                        flag = session.state.model.require_backward_grad_sync
                        results.setdefault("overlap_flags", []).append(flag)
                    inputs, targets = next(batches)
                    nn.functional.cross_entropy(model(inputs), targets).backward()
                inputs, targets = next(batches)
                nn.functional.cross_entropy(model(inputs), targets).backward()
                inner = model if plain else model.module
                nn.utils.clip_grad_norm_(inner.parameters(), 0.05)
                optimizer.step()
            results[way] = {"model": type(model).__name__}
            if session is not None:
                batches.close()
                results[way]["calls"] = session.finish().get("grad_sync", {}).get("calls")
                results[way]["noted"] = any("came without Distributed" in n for n in session.notes)
            if session is not None:
                results[way]["session_model"] = type(session.state.model).__name__
            inner = model if plain else model.module
            params = torch.cat([p.detach().reshape(-1) for p in inner.parameters()])
            results[way]["params"] = params
        return results
    finally:
        torch.distributed.destroy_process_group()


def gan_on_two_ranks(ways: list[str], steps: int = 4) -> dict[str, Any]:
    """In one 2-rank group, DCGAN's loop: a discriminator step (real, then a detached
    fake), then a generator step through the discriminator. Each rank is seeded apart
    (its own initial models and noise, as a GAN seeded by rank), its real batches its
    shard. ``ddp``: both models in DistributedDataParallel (the plain script); the
    others prepare the discriminator and register the generator and its optimizer,
    without DDP (``ddp_overlap``: under it); ``unsharded``: as ``plain``, its loader
    without a DistributedSampler, and a third model registered that shares a layer
    with the discriminator; ``session_backward``: as ``plain``, the generator's loss
    through ``session.backward``; ``one_optimizer``: one optimizer over both models,
    prepared, the generator registered alone; ``g_in_ddp``: as ``plain``, the generator
    in the script's own DistributedDataParallel, its ``.module`` registered (a dead
    weakref proxy alive as the session starts). Returns each way's final parameters per
    model, the generator's gradients after its first backward, and the session's
    notes."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    world = init_world("cpu", "gloo")
    results: dict[str, Any] = {}
    try:
        for way in ways:
            torch.manual_seed(0)
            real = TensorDataset(torch.randn(4 * steps, 4) + 2)
            sampler = DistributedSampler(real, world.world_size, world.rank, shuffle=False)
            loader: Any = DataLoader(real, batch_size=2, sampler=sampler)
            if way == "unsharded":
                loader = DataLoader(real, batch_size=2, shuffle=True)
            torch.manual_seed(world.rank)
            net_d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
            net_g = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
            opt_d = torch.optim.Adam(net_d.parameters(), lr=0.01)
            opt_g = torch.optim.Adam(net_g.parameters(), lr=0.01)
            if way == "one_optimizer":
                opt_d = opt_g = torch.optim.Adam([*net_d.parameters(), *net_g.parameters()])
            session = None
            if way in ("ddp", "g_in_ddp"):
                net_g = nn.parallel.DistributedDataParallel(net_g)
            if way == "ddp":
                net_d = nn.parallel.DistributedDataParallel(net_d)
            else:
                chosen = [get_optimization("ddp_overlap")(1.0)] if way == "ddp_overlap" else []
                session = Session(chosen, device="cpu")
                more: dict[str, Any] = {"opt_g": opt_g} if way != "one_optimizer" else {}
                if way == "unsharded":  # its draws differ anyway
                    tied = nn.Sequential(net_d[0], nn.ReLU(), nn.Linear(8, 4))
                    more |= {"tied": tied, "opt_t": torch.optim.SGD(tied[2].parameters(), 0.1)}
                net_d, opt_d, loader = session.prepare(net_d, opt_d, loader)
                # A dead weakref proxy alive at the start (numpy's npz BagObj holds one):
                # looking for the script's DDP wrappers must not read its class.
                dead = weakref.proxy(contextlib.ExitStack())  # noqa: F841
                session.start(net_g=getattr(net_g, "module", net_g), **more)
            bce = nn.BCEWithLogitsLoss()
            first: dict[str, torch.Tensor] = {}
            for (batch,) in loader:
                net_d.zero_grad()
                bce(net_d(batch), torch.ones(2, 1)).backward()
                fake = net_g(torch.randn(2, 3))
                bce(net_d(fake.detach()), torch.zeros(2, 1)).backward()
                if opt_d is not opt_g:  # one optimizer over both: its step is at the end
                    opt_d.step()
                net_g.zero_grad()
                loss_g = bce(net_d(fake), torch.ones(2, 1))
                if way == "session_backward":
                    session.backward(loss_g)
                else:
                    loss_g.backward()
                inner_g = getattr(net_g, "module", net_g)
                first = first or {
                    "grad": torch.cat([p.grad.reshape(-1) for p in inner_g.parameters()])
                }
                opt_g.step()
            results[way] = {"notes": session.finish()["notes"] if session else [], **first}
            for name, net in (("d", net_d), ("g", net_g)):
                inner = getattr(net, "module", net)
                results[way][name] = torch.cat([p.detach().reshape(-1) for p in inner.parameters()])
        return results
    finally:
        torch.distributed.destroy_process_group()


class TwoHeads(nn.Module):
    """Returns two outputs; the tests' loss uses only the second."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return features * 0, self.head(features)


class CheckpointedSegments(nn.Module):
    """Recomputes every layer in backward (reentrant activation checkpointing, as
    long-sequence scripts do): each segment's backward is a pass of its own, and no
    parameter's gradient accumulates in the outer pass. Returns two outputs, as
    `TwoHeads`: the loss's misses the output the session hooks."""

    def __init__(self) -> None:
        super().__init__()
        widths = [192, 64, 64, 64, 4]
        self.segments = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.ReLU())
            for a, b in zip(widths, widths[1:], strict=False)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.flatten(1).clone().requires_grad_()  # the first segment's input
        for segment in self.segments:
            x = torch.utils.checkpoint.checkpoint(segment, x, use_reentrant=True)
        return x * 0, x


def backwards_the_session_cannot_see(steps: int = 4) -> dict[str, Any]:
    """In one 2-rank group, backward passes that never reach the output the session
    hooks: a loss on a model's second output only, and a second backward through a
    part of the model. Each way syncs with the flat all-reduce (the session's own,
    and ddp_overlap's no_overlap baseline), clipping the gradients before each step;
    returns each one's final parameters and the norms clipping saw, and the DDP
    script's type checks. And the session's all-reduces per step of a model whose
    segments are recomputed in backward, each segment's backward a pass of its own."""
    world = init_world("cpu", "gloo")
    results: dict[str, Any] = {}
    try:
        for sync in ("session", "no_overlap"):
            for pattern in ("second_output", "part_of_the_model", "checkpointed_segments"):
                seed_everything(0)
                model: Any = (
                    CheckpointedSegments() if pattern == "checkpointed_segments" else TwoHeads()
                )
                chosen = [get_optimization("ddp_overlap")(0.0)] if sync == "no_overlap" else []
                session = Session(chosen, device="cpu")
                optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
                model, optimizer, _ = session.prepare(model, optimizer)
                torch.manual_seed(world.rank)  # each rank its own data
                norms = []
                for inputs in session.steps(steps, [torch.randn(8, *SHAPE)] * steps):
                    optimizer.zero_grad()
                    _, out = model(inputs)
                    out.square().mean().backward()
                    if pattern == "part_of_the_model":
                        model.head(torch.randn(8, 4)).square().mean().backward()
                    norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
                    optimizer.step()
                summary = session.finish()
                params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                results[f"{sync}/{pattern}"] = params, norms
                if sync == "session" and pattern == "checkpointed_segments":
                    results[f"all-reduces/{pattern}"] = summary["grad_sync"]["calls"]
        seed_everything(0)
        chosen = [get_optimization("ddp_overlap")(0.0)]
        session = Session(chosen, device="cpu")
        model, _, _ = session.prepare(nn.parallel.DistributedDataParallel(mlp()))
        results["no_overlap/ddp_script"] = type(model).__name__, type(model.module).__name__
        session.finish()
        return results
    finally:
        torch.distributed.destroy_process_group()


def batchnorm_statistics(steps: int = 4) -> dict[str, torch.Tensor]:
    """In one 2-rank group, a model with batch norm trained by the DDP script and by its
    port (the session's flat all-reduce; ddp_overlap's no_overlap baseline): each
    way's running statistics and parameters, as this rank ends with them, and its EMA
    of both (torchvision's classification script: ``AveragedModel(use_buffers=True)``
    updated after each optimizer step, made after prepare)."""
    world = init_world("cpu", "gloo", timeout_s=60)
    results = {}
    try:
        for way in ("ddp", "port", "no_overlap"):
            seed_everything(0)
            model: Any = nn.Sequential(
                nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model = nn.parallel.DistributedDataParallel(model)
            if way != "ddp":
                chosen = [get_optimization("ddp_overlap")(0.0)] if way == "no_overlap" else []
                session = Session(chosen, device="cpu")
                model, optimizer, _ = session.prepare(model, optimizer)
            ema = torch.optim.swa_utils.AveragedModel(
                model.module, multi_avg_fn=get_ema_multi_avg_fn(0.5), use_buffers=True
            )
            torch.manual_seed(world.rank)  # each rank its own batches
            batches = [
                (torch.randn(16, 6) * (1 + world.rank), torch.randint(3, (16,)))
                for _ in range(steps)
            ]
            for x, y in session.steps(steps, batches) if way != "ddp" else batches:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                ema.update_parameters(model)
            results[f"{way}/ema"] = torch.cat(
                [t.detach().reshape(-1).float() for t in ema.module.state_dict().values()]
            )
            model.eval()
            with torch.no_grad():
                if world.rank == 0:  # rank 0 alone (a sample, a summary): no collective
                    model.module(torch.randn(2, 6))
            if way != "ddp":
                session.finish()  # its gather would pair with a collective in that forward
            # The script's evaluation: under DDP its first forward takes rank 0's buffers.
            with torch.no_grad():
                torch.manual_seed(7)
                results[f"{way}/eval"] = model(torch.randn(8, 6))
            model.train()
            results[way] = torch.cat(
                [t.detach().reshape(-1).float() for t in model.module.state_dict().values()]
            )
        return results
    finally:
        torch.distributed.destroy_process_group()


def ddp_configs(configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """In one 2-rank process group, train once per config (kwargs of `train_mlp`)."""
    world = init_world("cpu", "gloo")
    try:
        return {
            name: train_mlp(world.world_size, world.rank, **kwargs)
            for name, kwargs in configs.items()
        }
    finally:
        torch.distributed.destroy_process_group()


class IndependentRanks(Optimization):
    """Stands in for pipeline stages: each rank trains its own model, no gradient sync."""

    name = "independent_ranks"
    provides = frozenset({"grad_sync"})


def stage_shards(root: str, steps: int) -> dict[str, Any]:
    """Each rank holds a different model, as a pipeline stage does, checkpointed as its own
    shard (``stage000``, ``stage001``); returns the parameters and where training began."""
    from overlapkit.runtime import Shard

    world = init_world("cpu", "gloo")
    try:
        seed_everything(world.rank)  # different weights on each rank: no replicas
        model = mlp()
        dataset = SyntheticImages(SHAPE, num_classes=4, num_samples=256, seed=world.rank)
        loader = ResumableLoader(dataset, 8, ShardedSampler(len(dataset), seed=world.rank))
        checkpoint = get_optimization("checkpoint")(every=2, keep=2, final=True)
        session = Session([IndependentRanks(), checkpoint], device="cpu", run_dir=root)
        session.state.shard = Shard(f"stage{world.rank:03d}", writer=True)
        model, optimizer, _ = session.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loader
        )
        summary = fit(session, model, steps)
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return {"params": params, "resumed_from": summary["optimizations"]["checkpoint"]}
    finally:
        torch.distributed.destroy_process_group()


def unequal_mlp() -> nn.Module:
    """Ten layers of very unequal cost: four wide ones up front, small ones after. Split
    into 5 + 5 layers, the first stage does ~3x the second's work; at its best, ~1.1x."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(192, 768),
        nn.Linear(768, 768),
        nn.Linear(768, 768),
        nn.Linear(768, 768),
        nn.Linear(768, 768),
        nn.Linear(768, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.Linear(16, 4),
    )


def first_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch every pipeline test starts from (replica 0's first)."""
    dataset = SyntheticImages(SHAPE, num_classes=4, num_samples=512, seed=0)
    indices = ShardedSampler(len(dataset), 0, 1, seed=0).indices()[:batch_size]
    return torch.utils.data.default_collate([dataset[i] for i in indices])


def stage_grads(pipe: Any) -> dict[str, torch.Tensor]:
    """This rank's gradients under the unsplit model's parameter names."""
    grads = {}
    for part in pipe._parts:
        original = {key.replace(".", "_"): key for key in part.names}
        for key, param in part.named_parameters():
            _, layer, rest = key.split(".", 2)
            grads[f"{original[layer]}.{rest}"] = param.grad.detach().clone()
    return grads


def pipeline_runs(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """In one process group, per config: one step of the unequal MLP under ``pipeline``
    (its settings in ``config["pipeline"]``, other optimizations beside), then
    ``config["steps"] - 1`` more; returns the first step's loss and gradients, the final
    parameters of this rank's stages and the summary."""
    world = init_world("cpu", "gloo")
    results = {}
    try:
        for name, config in configs.items():
            seed_everything(0)
            model = unequal_mlp()
            pipe = get_optimization("pipeline")(**config["pipeline"])
            others = [
                get_optimization(other)(**settings)
                for other, settings in config.get("others", {}).items()
            ]
            session = Session([pipe, *others], world=world, device="cpu", run_dir=config.get("dir"))
            shard, shards = session.data_shard
            dataset = SyntheticImages(SHAPE, num_classes=4, num_samples=512, seed=0)
            batch = config.get("batch_size", 16)
            loader = ResumableLoader(dataset, batch, ShardedSampler(len(dataset), shard, shards))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            model, optimizer, _ = session.prepare(model, optimizer, loader)
            first: dict[str, Any] = {}
            for inputs, targets in session.steps(config.get("steps", 1)):
                loss = session.forward_backward(inputs, targets, nn.functional.cross_entropy)
                if not first:
                    first = {
                        "loss": None if loss is None else float(loss),
                        "grads": stage_grads(pipe),
                    }
                session.optimizer_step()
                session.end_step()
            summary = session.finish()
            params = {
                key: value.detach().clone()
                for part in pipe._parts
                for key, value in part.state_dict().items()
            }
            results[name] = {
                **first,
                "params": params,
                "summary": summary,
                "data_shard": (shard, shards),
            }
        return results
    finally:
        torch.distributed.destroy_process_group()


def batchnorm_mlp() -> nn.Module:
    """Eight layers, a batch norm in each half (split equally: one on each stage)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(192, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 4),
    )


def pipeline_batchnorm(evaluate: bool) -> dict[str, Any]:
    """The batch-norm MLP in 2 GPipe stages of 4 micro-batches, batches of 16: 2 steps,
    then (``evaluate``) `Session.evaluate` over 40 samples in batches of 24 (larger than
    a training batch, and a short last one) and one more step. Returns this rank's stage
    (parameters and buffers) after the first 2 steps and at the end, and the evaluation."""
    world = init_world("cpu", "gloo")
    try:
        seed_everything(0)
        model = batchnorm_mlp()
        pipe = get_optimization("pipeline")(
            stages=2, microbatches=4, schedule="gpipe", split="equal"
        )
        session = Session([pipe], world=world, device="cpu")
        dataset = SyntheticImages(SHAPE, num_classes=4, num_samples=512, seed=0)
        loader = ResumableLoader(dataset, 16, ShardedSampler(len(dataset), 0, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer, _ = session.prepare(model, optimizer, loader)
        eval_set = SyntheticImages(SHAPE, num_classes=4, num_samples=40, seed=1)

        def stage() -> dict[str, torch.Tensor]:
            return {k: v.detach().clone() for k, v in model.state_dict().items()}

        result: dict[str, Any] = {}
        for inputs, targets in session.steps(3 if evaluate else 2):
            session.forward_backward(inputs, targets, nn.functional.cross_entropy)
            session.optimizer_step()
            session.end_step()
            if session.state.step == 2:
                result["after 2 steps"] = stage()
                if evaluate:
                    eval_loader = torch.utils.data.DataLoader(eval_set, batch_size=24)
                    result["evaluation"] = session.evaluate(eval_loader)
        result["end"] = stage()
        session.finish()
        return result
    finally:
        torch.distributed.destroy_process_group()


def pipeline_replica_buffers(schedules: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """The batch-norm MLP in 2 stages, each with 2 replicas (4 ranks), under each of
    ``schedules`` (with several stages per rank when it interleaves): 2 steps, then an
    evaluation; returns this rank's buffers after it (before `finish`), by schedule."""
    world = init_world("cpu", "gloo")
    results = {}
    try:
        for schedule in schedules:
            seed_everything(0)
            model = batchnorm_mlp()
            per_rank = {"stages_per_rank": 2} if schedule == "interleaved_1f1b" else {}
            pipe = get_optimization("pipeline")(
                stages=2, microbatches=4, schedule=schedule, split="equal", **per_rank
            )
            session = Session([pipe], world=world, device="cpu")
            shard, shards = session.data_shard
            dataset = SyntheticImages(SHAPE, num_classes=4, num_samples=512, seed=0)
            loader = ResumableLoader(dataset, 16, ShardedSampler(len(dataset), shard, shards))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            model, optimizer, _ = session.prepare(model, optimizer, loader)
            for inputs, targets in session.steps(2):
                session.forward_backward(inputs, targets, nn.functional.cross_entropy)
                session.optimizer_step()
                session.end_step()
            eval_set = SyntheticImages(SHAPE, num_classes=4, num_samples=32, seed=1)
            session.evaluate(torch.utils.data.DataLoader(eval_set, batch_size=16))
            results[schedule] = {k: v.detach().clone() for k, v in model.named_buffers()}
            session.finish()
        return results
    finally:
        torch.distributed.destroy_process_group()


def pipeline_script_mistakes() -> dict[str, str]:
    """A script's mistakes under pipeline, each caught where it is made (on every rank
    alike): a sampler sharded over all ranks, its own model(x), a short last batch."""
    world = init_world("cpu", "gloo")
    said: dict[str, str] = {}
    dataset = SyntheticImages(SHAPE, num_classes=4, num_samples=40, seed=0)

    def session_for(sampler: Any, drop_last: bool) -> tuple[Session, nn.Module, Any]:
        seed_everything(0)
        model = unequal_mlp()
        pipe = get_optimization("pipeline")(
            stages=2, microbatches=4, schedule="gpipe", split="equal"
        )
        session = Session([pipe], world=world, device="cpu")
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=16, sampler=sampler, drop_last=drop_last
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, _, loader = session.prepare(model, optimizer, loader)
        return session, model, loader

    def train(session: Session, loader: Any) -> None:
        for inputs, targets in loader:
            session.forward_backward(inputs, targets, nn.functional.cross_entropy)
            session.optimizer_step()

    try:
        try:  # the data-parallel way: every rank a shard of its own
            sampler = torch.utils.data.DistributedSampler(
                dataset, world.world_size, world.rank, shuffle=False
            )
            session, model, loader = session_for(sampler, drop_last=True)
            train(session, loader)
            said["sampler"] = "no error"
        except Exception as error:  # noqa: BLE001
            said["sampler"] = str(error)
        try:
            session, model, loader = session_for(None, drop_last=True)
            for inputs, _targets in loader:
                model(inputs)
                said["model(x)"] = "no error"
                break
        except Exception as error:  # noqa: BLE001
            said["model(x)"] = str(error)
        try:  # after training, the script's own evaluation with model(x)
            session, model, loader = session_for(None, drop_last=True)
            train(session, loader)
            model.eval()
            with torch.no_grad():
                model(next(iter(loader))[0])
            said["model(x) after"] = "no error"
        except Exception as error:  # noqa: BLE001
            said["model(x) after"] = str(error)
        try:  # 40 samples in batches of 16: the last has 8
            session, model, loader = session_for(None, drop_last=False)
            train(session, loader)
            said["short batch"] = "no error"
        except Exception as error:  # noqa: BLE001
            said["short batch"] = str(error)
        return said
    finally:
        torch.distributed.destroy_process_group()


def node_local_checkpoints(
    roots: list[str], steps: int, knobs: dict[str, Any], overheads: list[float] | None = None
) -> dict[str, Any]:
    """Data-parallel ranks, each checkpointing into the folder ``roots[rank]`` (ranks given
    one folder share it), as ranks on machines without a shared file system do;
    ``overheads[rank]`` gives each rank its own auto-mode bound, so that left alone they
    would checkpoint at different steps."""
    world = init_world("cpu", "gloo")
    try:
        model, loader = seeded_mlp_and_shard(world.rank, world.world_size, 256, 8)
        if overheads is not None:
            knobs = {**knobs, "max_overhead": overheads[world.rank]}
        checkpoint = get_optimization("checkpoint")(**knobs)
        session = Session([checkpoint], device="cpu", run_dir=roots[world.rank])
        model, optimizer, _ = session.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loader
        )
        seed_everything(1 + world.rank)
        summary = fit(session, model, steps)
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        losses = {r["step"]: r["loss"] for r in session.records}
        return {
            "params": params,
            "losses": losses,
            "checkpoint": summary["optimizations"]["checkpoint"],
        }
    finally:
        torch.distributed.destroy_process_group()


def run_in_a_group_started_before(scenario_file: str, run_dir: str) -> dict[str, Any]:
    """As under Ray Train's TorchTrainer: the process group exists before overlapkit's
    rank starts; overlapkit must train in it and leave it to its owner."""
    from pathlib import Path

    from overlapkit.run import rank_main
    from overlapkit.scenarios import load_scenario

    torch.distributed.init_process_group("gloo")  # env://, from the launcher's variables
    try:
        summary = rank_main(load_scenario(Path(scenario_file)), Path(run_dir), False, False)
        still_there = torch.distributed.is_initialized()
        torch.distributed.barrier()  # the group still works after the run
        return {"final_loss": summary["final_loss"], "group_kept": still_there}
    finally:
        torch.distributed.destroy_process_group()


def v_schedule_link_warmup(schedule: str) -> list[int]:
    """The links' warm-up as torch before 2.13 runs it for ``schedule``'s stages on this
    rank: every stage's warm-up sends and receives in one batch (2.13 no longer calls
    it; torch 2.11, on the GPU machine and the V100 clusters, does). Returns the stages."""
    import torch.distributed as dist
    from torch.distributed.pipelining.schedules import _batch_p2p, _wait_batch_p2p

    from overlapkit.optimizations.pipeline.layers import StageModule
    from overlapkit.optimizations.pipeline.schedules import SCHEDULES
    from overlapkit.optimizations.pipeline.stage import StepMeter, TimedStage

    world = init_world("cpu", "gloo")
    kind = SCHEDULES[schedule]
    total = 2 * world.world_size
    ids = kind.stage_ids(world.rank, world.world_size, 2)
    on_rank = {
        s: r for r in range(world.world_size) for s in kind.stage_ids(r, world.world_size, 2)
    }
    meter = StepMeter(world.device)
    stages = []
    for stage_id in ids:
        part = StageModule([(f"layer{stage_id}", nn.Linear(4, 4))])
        stage = TimedStage(part, stage_id, total, world.device, meter=meter, part=part)
        stage.stage_index_to_group_rank = on_rank
        stages.append(stage)
    ops = [op for stage in stages for op in stage._get_init_p2p_neighbors_ops()]
    _wait_batch_p2p(_batch_p2p(ops))
    dist.barrier()
    return ids


def spawned_worker(rank: int, init_method: str, session_first: bool, out: str) -> None:
    """A worker in the shape of pytorch/examples' imagenet script: ``mp.spawn`` starts
    it with no RANK in its environment and it starts its own process group; its
    ranks start from parameters of their own (mp.spawn's workers are not seeded)."""
    session = Session() if session_first else None
    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        torch.set_num_threads(2)  # torch's default on 2 cores: each rank all of them
        if session is None:  # as if on two machines: rank 1's GPU would be its machine's 0
            # VMs cloned from one image: the same host name, booted apart.
            from overlapkit.runtime import hardware

            socket.gethostname = lambda: "localhost"
            hardware.BOOT_ID = Path(out) / f"boot-id-{rank}"
            hardware.BOOT_ID.write_text(f"boot {rank}\n")
        session = session or Session()
        place = (session.world.local_rank, session.world.local_world_size)
        threads = torch.get_num_threads()
        torch.manual_seed(rank)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(3)]
        try:
            model, optimizer, loader = session.prepare(model, optimizer, batches)
        except RuntimeError as error:
            torch.save({"error": str(error)}, f"{out}/rank{rank}.pt")
            return
        for inputs, targets in loader:
            nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        summary = session.finish()
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        result = {
            "params": params,
            "world_size": summary["world_size"],
            "threads": threads,
            "place": place,
        }
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def models_split_across_ranks(steps: int = 3) -> dict[str, Any]:
    """In one gloo group (of the ranks launched: 2, or 1), models split across ranks,
    each given to `Session.prepare`: FSDP's flat shards (``fsdp``) and its original
    parameters (``fsdp_orig_params``), FSDP2's ``fully_shard`` and tensor parallel's
    DTensors; and an FSDP model registered beside a plain prepared one. Each returns
    its error (None: accepted) and whether the rank's part stayed as it was. Then
    ``DataParallel(model)`` ported (``data_parallel``) against the same script in
    DDP (``ddp``): final parameters, the model returned and trained, the notes, and
    a DataParallel script's checkpoint (``module.`` keys) loaded into the port."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if not dist.is_initialized():  # FSDP and a device mesh need a group, alone too
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    cpu = torch.device("cpu")  # FSDP1 asks for an accelerator unless told

    def small() -> nn.Module:
        torch.manual_seed(rank)  # the ranks start apart, as a script seeded by rank
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def sharded(model: nn.Module) -> nn.Module:
        fully_shard(model, mesh=mesh)
        return model

    def local(model: nn.Module) -> list[torch.Tensor]:
        return [getattr(p, "to_local", p.detach)().detach().clone() for p in model.parameters()]

    builders = {
        "fsdp": lambda: FullyShardedDataParallel(small(), device_id=cpu),
        "fsdp_orig_params": lambda: FullyShardedDataParallel(
            small(), device_id=cpu, use_orig_params=True
        ),
        "fully_shard": lambda: sharded(small()),
        "tensor_parallel": lambda: parallelize_module(
            small(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}
        ),
    }
    results: dict[str, Any] = {}
    try:
        for way, build in builders.items():
            model = build()
            before = local(model)
            session = Session(device="cpu", progress=False)
            try:
                session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
                error = None
            except ValueError as refused:
                error = str(refused)
            unchanged = all(map(torch.equal, before, local(model)))
            results[way] = {"error": error, "unchanged": unchanged}
            session.finish()
        session = Session(device="cpu", progress=False)
        session.prepare(small(), None)
        net_g = builders["fsdp"]()  # a GAN's generator, with its own optimizer
        try:
            session.start(net_g=net_g, optimizer_g=torch.optim.SGD(net_g.parameters(), lr=0.1))
            results["registered"] = None
        except ValueError as refused:
            results["registered"] = str(refused)
        session.finish()
        for way in ("ddp", "data_parallel"):
            model = small()
            wrapper = (
                nn.DataParallel if way == "data_parallel" else nn.parallel.DistributedDataParallel
            )
            wrapped: Any = wrapper(model)
            optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
            generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
            batches: Any = [
                (
                    torch.randn(4, 4, generator=generator),
                    torch.randint(0, 2, (4,), generator=generator),
                )
                for _ in range(steps)
            ]
            session = Session(device="cpu", progress=False) if way == "data_parallel" else None
            if session is not None:
                wrapped, optimizer, batches = session.prepare(wrapped, optimizer, batches)
            for inputs, targets in batches:
                optimizer.zero_grad()
                nn.functional.cross_entropy(wrapped(inputs), targets).backward()
                optimizer.step()
            params = torch.cat([p.detach().flatten() for p in wrapped.module.parameters()])
            results[way] = {"params": params}
            if session is not None:
                session.finish()
                results[way]["notes"] = session.notes
                results[way]["returned"] = type(wrapped).__name__
                results[way]["trained"] = type(session.state.model).__name__
                wrapped.load_state_dict(nn.DataParallel(small()).state_dict())
                results[way]["loaded"] = all(
                    map(torch.equal, model.parameters(), small().parameters())
                )
        return results
    finally:
        dist.barrier()
        dist.destroy_process_group()


def straggling_backward(ways: list[str], delay: float, steps: int = 4) -> dict[str, Any]:
    """In one 2-rank group, a DDP script under ``ddp_overlap`` whose rank 1 reaches
    backward ``delay`` seconds late every step, so that rank 0's all-reduce waits for
    it: with the script's own ``loss.backward()`` (``plain``) and `Session.backward`
    (``explicit``). Returns rank 0's and rank 1's step records' phase times per way."""
    import time

    world = init_world("cpu", "gloo")
    results: dict[str, Any] = {}
    try:
        for way in ways:
            model, loader = seeded_mlp_and_shard(world.rank, world.world_size, 256, 16)
            model = nn.parallel.DistributedDataParallel(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            session = Session([get_optimization("ddp_overlap")(1.0)], device="cpu")
            model, optimizer, loader = session.prepare(model, optimizer, loader)
            batches = iter(loader)
            for _ in range(steps):
                inputs, targets = next(batches)
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(inputs), targets)
                if world.rank == 1:
                    time.sleep(delay)
                if way == "explicit":
                    session.backward(loss)
                else:
                    loss.backward()
                optimizer.step()
            batches.close()
            session.finish()
            results[way] = [r["phases_s"] for r in session.records if r["rank"] == world.rank]
        return results
    finally:
        torch.distributed.destroy_process_group()


def save_on_one_rank_first(run_dir: str, late_s: float, sessions: int = 1) -> dict[str, Any]:
    """In one 2-rank group, ``sessions`` sessions one after the other, each two steps
    and a `Session.save` that rank 1 calls ``late_s`` seconds after rank 0 (as if it
    never would: a script saving on rank 0 only). Returns the LoopWarnings each rank
    got (in every session) and the folder its last save returned."""
    import time
    import warnings

    import overlapkit.runtime.saved_state as saved_state

    saved_state.SAVE_WAIT_TOLD_S = late_s / 4
    world = init_world("cpu", "gloo")
    try:
        said: list[str] = []
        for _ in range(sessions):
            model, loader = seeded_mlp_and_shard(world.rank, world.world_size, 64, 16)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            session = Session(device="cpu", run_dir=run_dir)
            model, optimizer, loader = session.prepare(model, optimizer, loader)
            for inputs, targets in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(inputs), targets).backward()
                optimizer.step()
            if world.rank == 1:
                time.sleep(late_s)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                saved = session.save()
            session.finish()
            said += [str(w.message) for w in caught]
        return {"warnings": said, "saved": str(saved)}
    finally:
        torch.distributed.destroy_process_group()

"""Host buffers for snapshots: one slab for the whole state, allocated off the critical
path after the first step, never inside a checkpoint's stall."""

import torch
from rank_programs import mlp

from overlapkit import Session, get_optimization
from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages
from overlapkit.optimizations.checkpoint import snapshot as snapshot_module
from overlapkit.optimizations.checkpoint.snapshot import HostBuffers, pinned_bytes, tensor_layout
from overlapkit.runtime.rng import seed_everything


def test_a_reserved_layout_is_one_aligned_slab_reused_by_every_snapshot():
    state = {"w": torch.randn(3, 5), "opt": [{"m": torch.randn(7)}], "step": 4}
    state["big"] = torch.randn(2048)  # 8 KiB
    buffers = HostBuffers(pin=False)
    buffers.reserve(tensor_layout(state))
    storages = {t.untyped_storage().data_ptr() for t in buffers.tensors.values()}
    assert len(storages) == 1
    # A block's tensor on a block boundary (the disk takes it from there); the small
    # ones packed, as in the file (a block each: 160 MB for a replay memory of 10k).
    assert buffers.tensors["/big"].data_ptr() % 4096 == 0
    small = [buffers.tensors[p].data_ptr() for p in ("/w", "/opt/0/m")]
    assert small[1] - small[0] == 64
    held = buffers.held_bytes
    assert buffers.get("/w", state["w"]) is buffers.tensors["/w"]  # no new allocation
    assert buffers.held_bytes == held
    buffers.get("/w", torch.randn(4, 5))  # a changed shape is allocated anew and counted
    assert buffers.held_bytes > held


def test_pinned_memory_is_counted_as_the_host_allocator_holds_it():
    assert pinned_bytes(205 * 2**20) == 256 * 2**20
    assert pinned_bytes(4096) == 4096


def test_no_buffer_is_allocated_inside_a_checkpoint(tmp_path, monkeypatch):
    allocated_in_take = []
    original_take = snapshot_module.Snapshotter.take
    original_empty = snapshot_module.aligned_empty
    inside = [False]

    def take(self, *args, **kwargs):
        inside[0] = True
        try:
            return original_take(self, *args, **kwargs)
        finally:
            inside[0] = False

    def aligned_empty(*args, **kwargs):
        if inside[0]:
            allocated_in_take.append(args[0])
        return original_empty(*args, **kwargs)

    monkeypatch.setattr(snapshot_module.Snapshotter, "take", take)
    monkeypatch.setattr(snapshot_module, "aligned_empty", aligned_empty)
    seed_everything(0)
    model = mlp()
    data = SyntheticImages((3, 8, 8), num_classes=4, num_samples=96, seed=0)
    loader = ResumableLoader(data, 16, ShardedSampler(len(data), seed=0))
    checkpoint = get_optimization("checkpoint")(every=2)
    session = Session([checkpoint], device="cpu", run_dir=tmp_path)
    model, optimizer, _ = session.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), loader
    )
    for inputs, targets in session.steps(7):
        with session.forward():
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        session.backward(loss)
        session.optimizer_step()
    section = session.finish()["optimizations"]["checkpoint"]
    assert section["checkpoints"] == 4  # steps 2, 4, 6 and the final one
    assert allocated_in_take == []  # every buffer came from the slab reserved after step 0
    buffers = checkpoint._snapshotter.sets[0]
    assert len({t.untyped_storage().data_ptr() for t in buffers.tensors.values()}) == 1
    assert section["pinned_bytes"] == 0  # nothing is pinned on a CPU


def test_the_summary_counts_buffers_a_reservation_still_under_way_makes(monkeypatch):
    """A run that ends soon after its first step reads the buffers' size while the
    background reservation may still be filling them: it waits for it (before, it
    read them mid-fill: too few bytes, or "dictionary changed size")."""
    import threading

    go = threading.Event()
    reserve = HostBuffers.reserve

    def held_back(self, layout):
        go.wait(30)
        reserve(self, layout)

    monkeypatch.setattr(HostBuffers, "reserve", held_back)
    state = {"w": torch.randn(64, 64), "opt": [{"m": torch.randn(64, 64)}]}
    snapshotter = snapshot_module.Snapshotter(torch.device("cpu"))
    snapshotter.reserve(tensor_layout(state))
    threading.Timer(0.2, go.set).start()  # the reservation finishes later
    assert snapshotter.buffer_bytes == 2 * 64 * 64 * 4
    assert snapshotter.held_bytes >= snapshotter.buffer_bytes

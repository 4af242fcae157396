"""Datasets and loaders: determinism, sharding, resumable position, local folders."""

import os
import pickle
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import running
from overlapkit.data import (
    Cifar10,
    DataError,
    DataNotFoundError,
    ImageFolder,
    Imdb,
    ResumableLoader,
    ShardedSampler,
    SyntheticImages,
    SyntheticTokens,
    build_loaders,
    hash_tokenize,
    spend,
)


def test_synthetic_samples_depend_only_on_seed_and_index():
    a, b = SyntheticImages(num_samples=10, seed=3), SyntheticImages(num_samples=10, seed=3)
    assert torch.equal(a[7][0], b[7][0]) and a[7][1] == b[7][1]
    assert not torch.equal(a[7][0], SyntheticImages(num_samples=10, seed=4)[7][0])
    held_out = SyntheticImages(num_samples=10, seed=3, split=1)
    assert not torch.equal(a[7][0], held_out[7][0])
    assert torch.equal(a.patterns, held_out.patterns)  # same task, other samples
    tokens, label = SyntheticTokens(seq_len=32, vocab_size=100, num_samples=5, seed=0)[2]
    assert tokens.shape == (32,) and tokens[0] == 1 and 0 <= label < 2
    assert int(tokens.min()) >= 1 and int(tokens.max()) < 100
    with pytest.raises(IndexError):
        a[10]


@pytest.mark.parametrize("kind", ["sleep", "cpu"])
def test_per_sample_cost_takes_the_time_asked(kind):
    import time

    start, cpu = time.perf_counter(), time.thread_time()
    spend(30, kind)
    assert time.perf_counter() - start >= 0.029
    used = time.thread_time() - cpu  # this thread's CPU: the same however busy the cores are
    if kind == "cpu":  # work, not wall time: 30 ms of CPU, not much more
        assert 0.029 <= used < 0.06
    else:  # asleep: the time passes without the core
        assert used < 0.015
    slow = SyntheticImages(num_samples=4, cost_ms=20, cost_kind=kind)
    start = time.perf_counter()
    slow[0], slow[1]
    assert time.perf_counter() - start >= 0.04


def test_shards_are_disjoint_and_cover_the_epoch():
    shards = [ShardedSampler(10, rank, 3, seed=1).indices() for rank in range(3)]
    assert all(len(s) == 3 for s in shards)  # drop_last: 9 of 10, evenly
    assert len(set().union(*shards)) == 9
    exact = [
        ShardedSampler(10, rank, 3, shuffle=False, drop_last=False).indices() for rank in range(3)
    ]
    assert sorted(i for s in exact for i in s) == list(range(10))
    sampler = ShardedSampler(10, seed=1)
    first = sampler.indices()
    sampler.set_epoch(1)
    assert sorted(sampler.indices()) == sorted(first) and sampler.indices() != first


def test_loader_resumes_with_exactly_the_next_batch():
    dataset = SyntheticImages((1, 2, 2), num_samples=20, seed=0)

    def loader():
        return ResumableLoader(dataset, 4, ShardedSampler(20, seed=5))

    reference = loader()
    straight = [batch[0] for _ in range(2) for batch in reference]  # two epochs of 5 batches
    interrupted = loader()
    iterator = iter(interrupted)
    seen = [next(iterator)[0] for _ in range(7 % 5)]  # two batches into epoch 0
    state = interrupted.state_dict()
    assert state == {"epoch": 0, "position": 2}
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [b[0] for b in resumed] + [b[0] for b in resumed]
    assert len(seen + rest) == len(straight)
    assert all(torch.equal(x, y) for x, y in zip(seen + rest, straight, strict=True))
    assert len(resumed) == 5 and resumed.state_dict() == {"epoch": 2, "position": 0}


def test_workers_give_the_same_batches_as_the_main_thread():
    dataset = SyntheticImages((3, 4, 4), num_samples=16, seed=0)
    inline = ResumableLoader(dataset, 4, ShardedSampler(16, seed=2))
    workers = ResumableLoader(dataset, 4, ShardedSampler(16, seed=2))
    workers.reconfigure(num_workers=2)
    for (a, la), (b, lb) in zip(inline, workers, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    # Its workers end with their parent (see the test of a killed script's loader).
    from overlapkit.data.worker_watch import EndsWithParent

    init = workers.loader.worker_init_fn
    assert isinstance(init, EndsWithParent) and init.init is None


def test_build_loaders_checks_the_global_batch():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        build_loaders(SyntheticImages(num_samples=10), None, 8, 0, 2, 0)


def write_cifar(root, per_batch=4):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": [int(x) for x in rng.integers(0, 10, per_batch)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    return folder


def test_cifar_reads_the_python_pickle_folder(tmp_path):
    folder = write_cifar(tmp_path)
    train, test = Cifar10(tmp_path, train=True), Cifar10(folder, train=False)
    assert len(train) == 20 and len(test) == 4
    image, label = train[0]
    assert image.shape == (3, 32, 32) and 0 <= label < 10
    with open(folder / "data_batch_1", "rb") as f:
        raw = pickle.load(f)[b"data"][0].reshape(3, 32, 32)
    expected = (
        torch.from_numpy(raw).float() / 255 - torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    ) / torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    assert torch.allclose(image, expected)


def test_cifar_refuses_pickles_that_carry_code(tmp_path):
    folder = write_cifar(tmp_path)

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(DataError, match="refusing to load builtins.print"):
        Cifar10(tmp_path, train=False)


def test_image_folder_decodes_resizes_and_crops(tmp_path):
    for split in ("train", "val"):
        for label, name in enumerate(["cat", "dog"]):
            (tmp_path / split / name).mkdir(parents=True)
            for i in range(2):
                colour = (255 * label, 40 * i, 0)
                Image.new("RGB", (50 + 10 * i, 40), colour).save(
                    tmp_path / split / name / f"{i}.png"
                )
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    dataset = ImageFolder(tmp_path, size=32, split="train")
    assert dataset.classes == ["cat", "dog"] and len(dataset) == 4
    image, label = dataset[3]
    assert image.shape == (3, 32, 32) and label == 1
    red = (1.0 - 0.485) / 0.229
    assert image[0].mean().item() == pytest.approx(red, rel=0.02)


def test_imdb_reads_the_review_folder_and_hashes_words(tmp_path):
    for split in ("train", "test"):
        for name in ("pos", "neg"):
            (tmp_path / "aclImdb" / split / name).mkdir(parents=True)
            (tmp_path / "aclImdb" / split / name / "0_7.txt").write_text(
                f"A {name} film.<br />Great!"
            )
    dataset = Imdb(tmp_path, train=True, seq_len=8, vocab_size=100)
    tokens, label = dataset[1]
    assert label == 1 and tokens.shape == (8,)
    assert torch.equal(tokens, hash_tokenize("a pos film great", 8, 100))
    assert tokens[0] == 1 and (tokens[5:] == 0).all()


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda p: Cifar10(p / "missing"), "CIFAR-10 folder not found"),
        (lambda p: ImageFolder(p), "no class folders under"),
        (lambda p: Imdb(p / "missing"), "IMDB folder not found"),
    ],
)
def test_missing_local_data_is_a_clear_error(tmp_path, make, fragment):
    with pytest.raises(DataNotFoundError, match=fragment) as error:
        make(tmp_path)
    assert "never downloads" in str(error.value) or "expected" in str(error.value)


def test_batches_of_named_tuples_mappings_and_own_classes_move_whole():
    """What a GPU step does to each batch (`to_device`; skipped on a CPU, so shown
    here moving to the meta device): a named tuple crashed ('missing 1 required
    positional argument'), a mapping that is not a dict (UserDict, Hugging Face's
    BatchEncoding) and a batch class with its own ``to`` stayed on the CPU."""
    from collections import UserDict, namedtuple

    from overlapkit.runtime.batch import batch_size, tensors_in, to_device

    meta = torch.device("meta")
    Pair = namedtuple("Pair", "inputs labels")
    moved = to_device(Pair(torch.zeros(4, 3), torch.zeros(4)), meta)
    assert type(moved) is Pair and moved.inputs.device == meta and moved.labels.device == meta

    class Encoding(UserDict):
        pass

    encoded = to_device(Encoding(input_ids=torch.zeros(5, 2), mask=[torch.ones(5)]), meta)
    assert type(encoded) is Encoding and encoded["input_ids"].device == meta
    assert encoded["mask"][0].device == meta
    assert [t.shape for t in tensors_in(Encoding(a=torch.zeros(2), b=(torch.zeros(3),)))] == [
        (2,),
        (3,),
    ]
    assert batch_size(Encoding(a=torch.zeros(7, 2))) == 7

    class Graph:
        def __init__(self, x):
            self.x = x

        def to(self, device, non_blocking=False):
            return Graph(self.x.to(device, non_blocking=non_blocking))

    assert to_device({"graph": Graph(torch.zeros(2))}, meta)["graph"].x.device == meta
    assert to_device(("text", 3, None), meta) == ("text", 3, None)


def test_a_packed_sequence_moves_by_its_own_to():
    """A named tuple with its own ``to``: rebuilt field by field, its batch_sizes went
    to the device ('batch_sizes should always be on CPU')."""
    from torch.nn.utils.rnn import pack_padded_sequence

    from overlapkit.runtime.batch import to_device

    packed = pack_padded_sequence(torch.zeros(3, 2, 4), [3, 2])
    moved = to_device({"text": packed}, torch.device("meta"))["text"]
    assert moved.data.device == torch.device("meta") and moved.batch_sizes.device.type == "cpu"


SCRIPT_WITH_WORKERS = """
import multiprocessing, sys, time
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from overlapkit import Session

class Big(Dataset):
    def __len__(self):
        return 1000
    def __getitem__(self, i):
        return np.zeros(200_000, dtype=np.float32)  # 800 KB, pickled by value

def by_value(batch):
    return batch  # numpy arrays travel through the workers' result pipe whole

if __name__ == "__main__":
    model = torch.nn.Linear(2, 2)
    loader = DataLoader(Big(), batch_size=1, num_workers=2, collate_fn=by_value)
    session = Session(device="cpu")
    model, optimizer, loader = session.prepare(model, torch.optim.SGD(model.parameters()), loader)
    for batch in loader:
        print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
        time.sleep(600)
"""


def test_a_killed_scripts_loader_workers_end_with_it(tmp_path):
    """A rank killed (SIGKILL, the OOM killer) while its DataLoader's result pipe was
    full left workers that never ended: each holds the pipe's read end, so its write
    never fails and its exit waits for it (one was found 37 minutes after a test)."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "script.py"
    script.write_text(SCRIPT_WITH_WORKERS)
    started = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers = [int(pid) for pid in started.stdout.readline().split()]
    assert len(workers) == 2

    def writing(pid: int) -> bool:  # a thread of it blocked in a write to the full pipe
        try:
            tasks = Path(f"/proc/{pid}/task").glob("*/wchan")
            return any("pipe_write" in task.read_text() for task in tasks)  # anon_pipe_write
        except OSError:
            return False

    deadline = time.monotonic() + 60
    while not any(map(writing, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(map(writing, workers)), "the workers never filled their result pipe"
    os.kill(started.pid, signal.SIGKILL)
    started.wait()

    deadline = time.monotonic() + 60
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in workers if running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived their killed script"


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfds: the parent is watched")
def test_a_worker_ends_with_its_loaders_process_even_when_that_is_not_its_parent():
    """Under forkserver (Python 3.14's default start method) a worker's parent is a
    server that outlives the rank: watching the parent, the worker outlived a killed
    rank for good. It now ends with the process that started it (that pickled its
    init), also when that one died before the worker's init ran (it was adopted, and
    stayed), and when the worker holds over 1024 files (select() refused the pidfd)."""
    import subprocess

    rank_code = (
        "import pickle, sys, time; from overlapkit.data.worker_watch import EndsWithParent; "
        "sys.stdout.buffer.write(pickle.dumps(EndsWithParent(None)).hex().encode() + b'\\n'); "
        "sys.stdout.flush(); time.sleep(float(sys.argv[1]))"
    )
    worker_code = (
        "import os, pickle, resource, sys, time\n"
        "if resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 1200:\n"
        "    files = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]\n"
        "init = pickle.loads(bytes.fromhex(sys.stdin.read()))\n"
        "init(0); print('started', flush=True); time.sleep(60)"
    )

    def rank_and_worker(lives_s: float) -> tuple[subprocess.Popen, subprocess.Popen]:
        rank = subprocess.Popen(
            [sys.executable, "-c", rank_code, str(lives_s)], stdout=subprocess.PIPE
        )
        init = rank.stdout.readline()  # pickled there: the worker is not its child
        if lives_s == 0:
            rank.wait(60)
        worker = subprocess.Popen(
            [sys.executable, "-c", worker_code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        worker.stdin.write(init)
        worker.stdin.close()
        return rank, worker

    _, early = rank_and_worker(0)
    assert early.wait(60) == 0 and early.stdout.read() == b""
    rank, worker = rank_and_worker(60)
    try:
        assert worker.stdout.readline() == b"started\n"
        rank.kill()
        assert worker.wait(30) == 0  # not its 60 s of sleep, and no kill of ours
    finally:
        rank.kill()
        worker.kill()

"""The checkpoint file format: exact round trips, checksums, O_DIRECT writes, no pickle."""

from __future__ import annotations

import os

import crc32c
import pytest
import torch

from overlapkit.optimizations.checkpoint import fileformat
from overlapkit.optimizations.checkpoint.snapshot import aligned_empty
from overlapkit.runtime.persist import atomic_write


def _tree() -> dict:
    big = aligned_empty(torch.Size([700_001]), torch.float32)  # > the 1 MiB bounce buffer
    big.copy_(torch.randn(700_001))
    return {
        "model": {"w": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64)},
        "big": big,
        "odd": torch.randn(10, 10).t(),  # not contiguous
        "bf16": torch.randn(33).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "meta": {1: ("a", None, 3.0), "flag": False, "list": [1, [2, torch.ones(2)]]},
    }


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(b) is dict and list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


def test_a_tree_round_trips_exactly_with_a_checksum_of_the_whole_file(tmp_path):
    tree = _tree()
    path = tmp_path / "state.ckpt"
    flags = []

    def write(fd: int):
        with open(f"/proc/self/fdinfo/{fd}") as info:
            flags.append(int(info.read().split("flags:")[1].split()[0], 8))
        return fileformat.write(fd, tree)

    record = atomic_write(path, write, direct=True)
    data = path.read_bytes()
    assert record["bytes"] == len(data)
    assert record["crc32c"] == f"{crc32c.crc32c(data):08x}"
    _assert_same(tree, fileformat.read(path))
    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        direct_possible = True
    except OSError:
        direct_possible = False
    # Here the disk took the aligned buffers directly (an unaligned write would fail).
    assert bool(flags[0] & os.O_DIRECT) == direct_possible


def test_small_tensors_are_packed_not_a_block_each(tmp_path):
    """A replay memory of 1000 transitions (4 small tensors each, 44 KB of data) was
    a 16 MB file: each tensor on a 4 KiB block of its own. Small ones are packed now;
    a block's tensor after them still starts on a block (O_DIRECT takes it as is)."""
    memory = [
        (torch.randn(4), torch.tensor([1]), torch.randn(4), torch.randn(1)) for _ in range(1000)
    ]
    big = aligned_empty(torch.Size([3000]), torch.float32)
    big.copy_(torch.randn(3000))
    tree = {"memory": memory, "big": big}
    path = tmp_path / "state.ckpt"
    record = atomic_write(path, lambda fd: fileformat.write(fd, tree), direct=True)
    assert record["bytes"] == path.stat().st_size < 1_000_000  # the header is half
    _assert_same(tree, fileformat.read(path))


def test_a_truncated_file_and_a_foreign_file_are_refused(tmp_path):
    path = tmp_path / "state.ckpt"
    atomic_write(path, lambda fd: fileformat.write(fd, _tree()), direct=True)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(fileformat.CheckpointFormatError, match="truncated"):
        fileformat.read(path)
    path.write_bytes(b"\x80\x04pickle" + data[20:])
    with pytest.raises(fileformat.CheckpointFormatError, match="not an overlapkit checkpoint"):
        fileformat.read(path)


def test_only_plain_values_can_be_written(tmp_path):
    with pytest.raises(TypeError, match="object"):
        atomic_write(tmp_path / "x.ckpt", lambda fd: fileformat.write(fd, {"x": object()}))
    assert not any(tmp_path.iterdir())  # nothing half-written is left behind

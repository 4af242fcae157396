"""Checkpoints across machines without a shared file system: each machine's ranks write
their own folder, the checksums travel by collectives, resume is agreed by a collective.
Ranks given folders of their own stand in for machines (two of one rank, or of two)."""

import json
import os

import pytest
import torch
from rank_programs import node_local_checkpoints

from overlapkit.launch.local import RankFailedError, launch_local

pytestmark = pytest.mark.slow


def manifest(root):
    return json.loads((root / "checkpoints" / "manifest.json").read_text())["checkpoints"]


def roots(tmp_path, name):
    return [str(tmp_path / name / f"node{rank}") for rank in (0, 1)]


def test_resume_from_separate_folders_matches_an_uninterrupted_run(tmp_path):
    straight = launch_local(node_local_checkpoints, 2, roots(tmp_path, "a"), 8, {"every": 2})
    nodes = roots(tmp_path, "b")
    launch_local(node_local_checkpoints, 2, nodes, 5, {"every": 2, "final": False})
    resumed = launch_local(node_local_checkpoints, 2, nodes, 8, {"every": 2})
    for rank in (0, 1):
        assert resumed[rank]["checkpoint"]["resumed_from_step"] == 4
        assert torch.equal(resumed[rank]["params"], straight[rank]["params"])
        assert sorted(resumed[rank]["losses"]) == [4, 5, 6, 7]
        assert all(resumed[rank]["losses"][s] == straight[rank]["losses"][s] for s in range(4, 8))


def test_two_machines_of_two_ranks_each_hold_their_own_ranks_and_resume_exactly(tmp_path):
    """Two groups of ranks, each group with a folder of its own (two machines of two
    ranks): each machine's manifest lists its own ranks' files and the replicated
    state once, and all four ranks resume from them exactly."""
    machines = [tmp_path / "run" / "machine0", tmp_path / "run" / "machine1"]
    folders = [str(machines[rank // 2]) for rank in range(4)]
    first = launch_local(node_local_checkpoints, 4, folders, 5, {"every": 2, "final": False})
    for machine, ranks in zip(machines, ((0, 1), (2, 3)), strict=True):
        entries = manifest(machine)
        assert [e["step"] for e in entries] == [2, 4]
        files = sorted([f"rank0000{r}.ckpt" for r in ranks] + ["shared.ckpt"])
        for entry in entries:
            assert sorted(entry["files"]) == files
            step = machine / "checkpoints" / f"step-{entry['step']:08d}"
            assert sorted(p.name for p in step.iterdir()) == files
    resumed = launch_local(node_local_checkpoints, 4, folders, 7, {"every": 2})
    for rank in range(4):
        assert resumed[rank]["checkpoint"]["resumed_from_step"] == 4
        assert sorted(resumed[rank]["losses"]) == [4, 5, 6]
        # Step 4 ran in both: from the checkpoint, bit for bit as the first time.
        assert resumed[rank]["losses"][4] == first[rank]["losses"][4]
    assert all(torch.equal(resumed[r]["params"], resumed[0]["params"]) for r in range(4))


def test_resume_agrees_on_the_newest_step_every_machine_holds(tmp_path):
    nodes = roots(tmp_path, "run")
    launch_local(node_local_checkpoints, 2, nodes, 4, {"every": 2, "keep": 5, "final": False})
    # Machine 1 lost its newest checkpoint: both resume from the one before.
    manifest_path = tmp_path / "run" / "node1" / "checkpoints" / "manifest.json"
    document = json.loads(manifest_path.read_text())
    document["checkpoints"] = [e for e in document["checkpoints"] if e["step"] != 4]
    manifest_path.write_text(json.dumps(document))
    resumed = launch_local(node_local_checkpoints, 2, nodes, 6, {"every": 2})
    assert [resumed[r]["checkpoint"]["resumed_from_step"] for r in (0, 1)] == [2, 2]


def test_a_machine_holding_no_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    nodes = roots(tmp_path, "run")
    launch_local(node_local_checkpoints, 2, nodes, 4, {"every": 2})
    nodes[1] = str(tmp_path / "run" / "elsewhere")  # rank 1 now starts where nothing is
    with pytest.raises(RankFailedError) as error:
        launch_local(node_local_checkpoints, 2, nodes, 6, {"every": 2})
    assert "rank(s) 1 hold no intact checkpoint" in error.value.details
    assert "resume: false" in error.value.details
    # What was there is untouched.
    assert [e["step"] for e in manifest(tmp_path / "run" / "node0")][-1] == 4


def test_ranks_that_would_choose_different_steps_in_auto_mode_checkpoint_together(tmp_path):
    nodes = roots(tmp_path, "run")
    knobs = {"every": "auto", "keep": 100, "final": False}
    # Left alone, rank 0 (a 1 % bound) and rank 1 (50 %) would checkpoint at other steps.
    # 60 steps: the first checkpoint comes at step 7, and the next one when its persist
    # is done (here steps 15 to 19; 40 steps left a slow disk room for only one).
    launch_local(node_local_checkpoints, 2, nodes, 60, knobs, [0.01, 0.5])
    steps = [[e["step"] for e in manifest(tmp_path / "run" / f"node{r}")] for r in (0, 1)]
    assert steps[0] == steps[1] and len(steps[0]) >= 2


def test_a_mirror_follows_a_machines_checkpoints_and_names_only_whole_ones(tmp_path, monkeypatch):
    """The driver's copy of a machine's checkpoint folder (`overlapkit run --ray`): new
    step folders fetched a chunk at a time, then the manifest, then the ones it no
    longer lists removed; a step gone, cut short or changed before it was fetched
    leaves the mirror's manifest as it was."""
    import crc32c

    from overlapkit.runtime import checkpoint_folder
    from overlapkit.runtime.checkpoint_folder import manifest_text, mirror, read_chunk

    monkeypatch.setattr(checkpoint_folder, "CHUNK_BYTES", 1000)
    there, here = tmp_path / "there", tmp_path / "here"

    def content(step):  # 2.5 chunks: a file of several chunks, the last one short
        return bytes((step * 7 + i) % 251 for i in range(2500))

    def record(data):
        return {"bytes": len(data), "crc32c": f"{crc32c.crc32c(data):08x}"}

    def write(steps):
        there.mkdir(exist_ok=True)
        for step in steps:
            folder = there / f"step-{step:08d}"
            folder.mkdir(exist_ok=True)
            (folder / "rank00000.ckpt").write_bytes(content(step))
            (folder / "empty.ckpt").write_bytes(b"")
        files = {
            s: {"rank00000.ckpt": record(content(s)), "empty.ckpt": record(b"")} for s in steps
        }
        listed = {"format": 1, "checkpoints": [{"step": s, "files": files[s]} for s in steps]}
        listed["setup"] = {"train": {"seed": steps[-1]}}  # what they are of: it travels too
        (there / "manifest.json").write_text(json.dumps(listed))
        return listed

    def listed(root):
        return [e["step"] for e in json.loads((root / "manifest.json").read_text())["checkpoints"]]

    asked = []

    def fetch(step, name, offset, size):
        asked.append(size)
        return read_chunk(there, step, name, offset, size)

    for steps in ([3], [3, 6], [6, 9]):
        write(steps)
        assert mirror(here, manifest_text(there), fetch)
        assert sorted(p.name for p in here.glob("step-*")) == [f"step-{s:08d}" for s in steps]
        assert listed(here) == steps
        assert json.loads(manifest_text(here))["setup"] == {"train": {"seed": steps[-1]}}
        newest = here / f"step-{steps[-1]:08d}"
        assert (newest / "rank00000.ckpt").read_bytes() == content(steps[-1])
        assert (newest / "empty.ckpt").read_bytes() == b""
    assert max(asked) == 1000 and 500 in asked  # never more than a chunk at once
    # A manifest read just before the machine dropped one of its steps (11: gone).
    moved_on = write([9, 11])
    (there / "step-00000011" / "rank00000.ckpt").unlink()
    assert not mirror(here, json.dumps(moved_on), fetch)
    assert listed(here) == [6, 9] and (here / "step-00000006").is_dir()
    assert not (here / "step-00000011").exists()
    # A step folder caught while the machine deleted it (a file short): not taken.
    cut = write([9, 12])
    with open(there / "step-00000012" / "rank00000.ckpt", "r+b") as f:
        f.truncate(1500)
    assert not mirror(here, json.dumps(cut), fetch)
    assert listed(here) == [6, 9] and not (here / "step-00000012").exists()
    # A file of the right size that is not what was checkpointed: not taken either.
    changed = write([9, 12])
    (there / "step-00000012" / "rank00000.ckpt").write_bytes(content(13))
    assert not mirror(here, json.dumps(changed), fetch)
    assert listed(here) == [6, 9] and not (here / "step-00000012").exists()
    write([9, 12])
    assert mirror(here, manifest_text(there), fetch)
    assert listed(here) == [9, 12] and not list(here.glob(".incoming-*"))
    # The machine wrote step 12 again (resumed from an older step): fetched again, not
    # kept with the new manifest's checksums describing the old bytes.
    again = write([9, 12])
    (there / "step-00000012" / "rank00000.ckpt").write_bytes(content(99))
    again["checkpoints"][1]["files"]["rank00000.ckpt"] = record(content(99))
    assert mirror(here, json.dumps(again), fetch)
    assert (here / "step-00000012" / "rank00000.ckpt").read_bytes() == content(99)
    assert listed(here) == [9, 12]


def test_a_run_folder_is_sent_without_the_checkpoints_moved_aside(tmp_path):
    """A resume under --ray sends each machine its run folder apart from its
    checkpoints (those travel in chunks); the ones a --fresh start moved aside
    (checkpoints.old-<time>) went along, gzipped in memory, and came back again."""
    import io
    import tarfile

    from overlapkit.launch.ray_nodes import pack

    for name in ("checkpoints", "checkpoints.old-20261124-074500", "nodes"):
        (tmp_path / name / "step-00000009").mkdir(parents=True)
        (tmp_path / name / "step-00000009" / "rank00000.ckpt").write_bytes(b"x" * 1000)
    (tmp_path / "summary.json").write_text("{}")
    archive = pack(tmp_path, skip=("nodes", "checkpoints"))
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        assert tar.getnames() == ["summary.json"]


def test_a_machines_run_folder_comes_back_without_its_lock(tmp_path):
    """What a machine sends back at the end of a --ray run is unpacked over the
    driver's run folder: a .lock in it wrote the machine's launcher's pid into the file
    the driver holds its lock on, and a second run into that folder was refused
    naming a process that is not the run (nor on this machine)."""
    from overlapkit.folders import FolderInUseError, check_free, held
    from overlapkit.launch.ray_nodes import NodeRunner, unpack

    machine = NodeRunner()
    (machine.folder / "run").mkdir()
    (machine.folder / "run" / ".lock").write_text("4242\n")  # its launcher's, long gone
    (machine.folder / "run" / "summary.json").write_text("{}")
    for name in ("stdout.txt", "stderr.txt"):
        (machine.folder / name).write_text("")
    driver = tmp_path / "run"
    driver.mkdir()
    with held(driver):
        unpack(machine.collect(), driver)
        assert (driver / "summary.json").exists()
        with pytest.raises(FolderInUseError, match=f"pid {os.getpid()}"):
            check_free(driver)


def test_an_earlier_runs_checkpoints_are_sent_back_a_chunk_at_a_time(tmp_path, monkeypatch):
    """What `overlapkit run --ray` sends each machine to resume: the files its manifest
    lists, written chunk by chunk in any order, then the manifest."""
    from overlapkit.runtime import checkpoint_folder
    from overlapkit.runtime.checkpoint_folder import (
        finish_files,
        listed_files,
        manifest_text,
        read_chunk,
        write_chunk,
    )

    monkeypatch.setattr(checkpoint_folder, "CHUNK_BYTES", 1000)
    here, there = tmp_path / "mirror", tmp_path / "machine"
    (here / "step-00000004").mkdir(parents=True)
    data = bytes(range(256)) * 10
    (here / "step-00000004" / "rank00000.ckpt").write_bytes(data)
    (here / "step-00000004" / "stray.tmp").write_bytes(b"not listed")
    files = {"rank00000.ckpt": {"bytes": len(data)}}
    (here / "manifest.json").write_text(json.dumps({"checkpoints": [{"step": 4, "files": files}]}))
    text = manifest_text(here)
    chunks = [
        (step, name, offset, read_chunk(here, step, name, offset, 1000))
        for step, name, size in listed_files(text)
        for offset in range(0, size, 1000)
    ]
    assert len(chunks) == 3
    for chunk in reversed(chunks):
        write_chunk(there, *chunk)
    finish_files(there, text)
    assert (there / "step-00000004" / "rank00000.ckpt").read_bytes() == data
    assert not (there / "step-00000004" / "stray.tmp").exists()
    assert manifest_text(there) == text or json.loads(manifest_text(there)) == json.loads(text)
    with pytest.raises(ValueError, match="not a checkpoint file name"):
        read_chunk(here, 4, "../manifest.json", 0, 10)


def machine_folder_with(root, steps):
    """A machine's checkpoint folder holding ``steps`` (one small file each)."""
    import crc32c

    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for step in steps:
        data = f"step {step}".encode()
        (root / f"step-{step:08d}").mkdir(exist_ok=True)
        (root / f"step-{step:08d}" / "rank00000.ckpt").write_bytes(data)
        record = {"bytes": len(data), "crc32c": f"{crc32c.crc32c(data):08x}"}
        entries.append({"step": step, "files": {"rank00000.ckpt": record}})
    (root / "manifest.json").write_text(json.dumps({"format": 1, "checkpoints": entries}))
    return (root / "manifest.json").read_text()


def test_mirrors_follow_machines_in_a_thread_of_their_own(tmp_path):
    """`run --ray` notes each machine's newest manifest and goes on watching the run
    while a checkpoint arrives: a machine whose copy is slow (here: held until the
    test lets it go) holds up neither the caller nor the other machine's copy."""
    import threading

    from overlapkit.runtime.checkpoint_folder import manifest_text, read_chunk
    from overlapkit.runtime.checkpoint_mirrors import Mirrors

    there = [tmp_path / "machine0", tmp_path / "machine1"]
    here = [tmp_path / "mirror0", tmp_path / "mirror1"]
    manifests = [machine_folder_with(there[0], [2]), machine_folder_with(there[1], [2])]
    held, asked = threading.Event(), threading.Event()

    def slow(step, name, offset, size):
        asked.set()
        assert held.wait(120), "never let go"
        return read_chunk(there[0], step, name, offset, size)

    def fast(step, name, offset, size):
        return read_chunk(there[1], step, name, offset, size)

    mirrors = Mirrors([slow, fast], here)
    updated = threading.Thread(target=mirrors.update, args=(manifests,))
    updated.start()
    updated.join(60)
    assert not updated.is_alive(), "update waited for a copy"
    assert asked.wait(60)
    for _ in range(600):  # machine 1's copy goes on while machine 0's is held
        if manifest_text(here[1]) is not None:
            break
        threading.Event().wait(0.1)
    assert json.loads(manifest_text(here[1])) == json.loads(manifests[1])
    assert manifest_text(here[0]) is None  # nothing named before it is whole
    manifests[1] = machine_folder_with(there[1], [2, 4])
    mirrors.update([None, manifests[1]])
    held.set()
    mirrors.finish()  # what the newest manifests list, then the thread ends
    assert [json.loads(manifest_text(h)) for h in here] == [json.loads(m) for m in manifests]
    assert (here[1] / "step-00000004" / "rank00000.ckpt").read_bytes() == b"step 4"


def test_mirrors_stop_gives_up_a_copy_and_a_disk_error_is_raised_to_the_caller(
    tmp_path, monkeypatch
):
    import threading

    from overlapkit.runtime import checkpoint_folder
    from overlapkit.runtime.checkpoint_folder import manifest_text, read_chunk
    from overlapkit.runtime.checkpoint_mirrors import Mirrors

    monkeypatch.setattr(checkpoint_folder, "CHUNK_BYTES", 3)  # two chunks a file

    there, here = tmp_path / "machine", tmp_path / "mirror"
    manifest = machine_folder_with(there, [2])
    held, asked = threading.Event(), threading.Event()

    def slow(step, name, offset, size):
        asked.set()
        assert held.wait(120)
        return read_chunk(there, step, name, offset, size)

    mirrors = Mirrors([slow], [here])
    mirrors.update([manifest])
    assert asked.wait(60)
    mirrors.stop()  # Ctrl-C while a checkpoint arrives: given up at its next chunk
    held.set()
    mirrors.finish()  # its thread has ended: nothing to wait for
    assert manifest_text(here) is None and not list(here.glob("step-*"))

    def full(step, name, offset, size):
        raise OSError(28, "No space left on device")

    mirrors = Mirrors([full], [here])
    mirrors.update([manifest])
    with pytest.raises(OSError, match="No space left"):
        mirrors.finish()

    class Gone(Exception):
        pass

    def lost(step, name, offset, size):
        raise Gone

    fetchers = [lost, lambda *chunk: read_chunk(there, *chunk)]
    mirrors = Mirrors(fetchers, [here, tmp_path / "m1"], gone=(Gone,))
    mirrors.update([manifest, manifest])
    mirrors.finish()  # no error: machine 0 is gone (the run says so), machine 1 copied
    assert json.loads(manifest_text(tmp_path / "m1")) == json.loads(manifest)
    assert manifest_text(here) is None


def test_a_run_on_several_machines_resumes_only_what_every_machine_mirrored(tmp_path):
    """Machine 0's mirror got step 6, machine 1's only step 3: the failure line names
    step 3, the newest both hold (it named 6, which the resume then refused)."""
    from overlapkit.launch.ray_run import _kept, _newest_checkpoint

    for folder, steps in ((tmp_path, [3, 6]), (tmp_path / "nodes" / "node1", [3])):
        (folder / "checkpoints").mkdir(parents=True)
        listed = {"format": 1, "checkpoints": [{"step": s} for s in steps]}
        (folder / "checkpoints" / "manifest.json").write_text(json.dumps(listed))
    assert _newest_checkpoint(tmp_path, 2) == 3
    assert "up to step 3" in _kept(tmp_path, 2)
    assert _newest_checkpoint(tmp_path, 3) is None  # machine 2 sent none
    assert "starts over" in _kept(tmp_path, 3)

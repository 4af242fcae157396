"""``overlapkit export``: a run's trained model out of its checkpoints, as one file
that needs no overlapkit to load.

A checkpoint is overlapkit's own format (see `fileformat`), and under pipeline each
stage's layers are in a file of their own, named as the stage names them. The
export takes the newest intact checkpoint (or the step asked for) and writes:

- torch: the model's ``state_dict`` with the unsplit model's names, by
  ``torch.save`` (``model.load_state_dict(torch.load(PATH))``);
- TensorFlow: the model's variables (its weights and its layers' RNG states, as the
  checkpoint holds them) by their Keras paths, in ``model.variables`` order, as a
  NumPy ``.npz``.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .folders import nearest_existing
from .optimizations.checkpoint.store import (
    CheckpointError,
    Manifest,
    checkpoint_folder,
    load_state,
    verify,
)
from .optimizations.pipeline.optimization import PARTITION_FILE
from .runtime.checkpoint_folder import MANIFEST
from .runtime.report import LIVE_STEPS

SHARED = "shared.ckpt"
STAGE_PREFIX = "stage"


class ExportError(ValueError):
    """The run's checkpoints cannot give the model (named in the message)."""


class MissingStages(ExportError):
    """A checkpoint step whose pipeline stages are not all here (another machine's)."""


@dataclass
class Exported:
    path: Path
    step: int
    tensors: int
    bytes: int
    framework: str
    skipped: list[str]  # newer checkpoints that were not intact, and why
    by_position: bool = False  # TensorFlow arrays named 0000... in model.variables order
    trained_to: int | None = None  # the steps the run trained, when past this checkpoint

    def how_to_load(self) -> str:
        if self.framework == "tensorflow":  # by order: Keras's names depend on what the
            return (  # process built before (dense_4 where the run had dense)
                f"w = numpy.load('{self.path}'); "
                "for v, k in zip(model.variables, w.files): v.assign(w[k])"
            )
        return f"model.load_state_dict(torch.load('{self.path}'))"


def checkpoint_root(folder: Path) -> Path:
    """The checkpoint folder of run folder ``folder`` (its scenario's checkpoint.dir,
    relative to it), or ``folder`` itself when it holds a manifest."""
    if (folder / MANIFEST).is_file():
        return folder
    if folder.is_file():
        raise ExportError(f"{folder}: a file; name a run folder (or a checkpoint folder)")
    if not folder.is_dir():
        raise ExportError(f"{folder}: no such run folder")
    step = folder.name.removeprefix("step-")
    if step.isdigit() and (folder.parent / MANIFEST).is_file():  # one step's folder
        raise ExportError(
            f"{folder}: one checkpoint's folder; name the checkpoint folder that holds it: "
            f"overlapkit export {folder.parent} --step {int(step)}"
        )
    directory = "checkpoints"
    try:
        scenario = yaml.safe_load((folder / "scenario.yaml").read_text()) or {}
        directory = ((scenario.get("optimizations") or {}).get("checkpoint") or {}).get(
            "dir", directory
        )
    except (OSError, yaml.YAMLError, AttributeError):
        pass  # a script's folder, or none: the default place
    root = checkpoint_folder(folder, str(directory))  # where the run put them
    if not (root / MANIFEST).is_file():
        raise ExportError(
            f"{folder} holds no checkpoint ({root / MANIFEST} is missing): export reads a "
            "run's checkpoints, so the run needs the checkpoint optimization (or "
            "session.save() in a script of its own)"
        )
    return root


def export_model(folder: Path, step: int | None = None, to: Path | None = None) -> Exported:
    """Write the model of ``folder``'s newest intact checkpoint (or of ``step``)."""
    if to is not None:
        _check_target(to)  # before reading a checkpoint (gigabytes, maybe)
    root = checkpoint_root(folder)
    entries = list(reversed(Manifest(root).read()))  # newest first
    if step is not None:
        entries = [e for e in entries if e["step"] == step]
        if not entries:
            listed = ", ".join(str(e["step"]) for e in Manifest(root).read()) or "none"
            raise ExportError(f"{root} holds no checkpoint at step {step} (it holds: {listed})")
    problems = []
    for entry in entries:
        held, damaged = _held_files(root, entry)
        files = model_files(held)
        problem = next((p for f in files if (p := held[f].problem())), None)
        if problem is None and files:
            try:
                state, framework = _model_state(root, entry["step"], [held[f] for f in files], held)
            except MissingStages as missing:  # another machine's copy lacks this step
                problems.append(f"step {entry['step']}: {missing}{damaged}")
                continue
            target = to or _default_path(folder, root, entry["step"], framework)
            done = _write(state, framework, target, entry["step"], problems)
            if step is None:  # the newest was asked for: the run's own last model?
                done.trained_to = _trained_past(folder, entry["step"])
            return done
        problems.append(f"step {entry['step']}: {problem or 'it holds no model'}")
    raise ExportError(
        f"no intact checkpoint in {root}: {'; '.join(problems) or 'none listed'}"
        + (
            ". Without a shared file system each machine keeps its own pipeline stages: "
            f"put each other machine's checkpoint folder under {root.parent / 'nodes'}/NAME/"
            f"{root.name} (run --ray leaves them there), then export"
            if any("stage files" in problem for problem in problems)
            else ""
        )
    )


@dataclass(frozen=True)
class Held:
    """One file of a checkpoint step, in the checkpoint folder whose manifest lists it."""

    root: Path
    entry: dict[str, Any]
    name: str

    def problem(self) -> str | None:
        return verify(self.root, self.entry, [self.name])

    def load(self) -> Any:
        return load_state(self.root, self.entry["step"], self.name)


def _held_files(root: Path, entry: dict[str, Any]) -> tuple[dict[str, Held], str]:
    """The files of step ``entry`` in ``root``, and those of the same step that the
    other machines of a run over several (``--ray``: ``RUN_DIR/nodes/*``) hold: a
    pipeline's stages are spread over them when they share no file system. Also what
    could not be read there (a damaged manifest: its files cannot be verified)."""
    held = {name: Held(root, entry, name) for name in entry["files"]}
    damaged = ""
    for other in sorted((root.parent / "nodes").glob(f"*/{root.name}")):
        try:
            theirs = [e for e in Manifest(other).read() if e["step"] == entry["step"]]
        except CheckpointError:
            damaged += f" ({other / MANIFEST} is damaged: its files were not used)"
            continue
        for name in theirs[0]["files"] if theirs else []:
            held.setdefault(name, Held(other, theirs[0], name))
    return held, damaged


def model_files(held: dict[str, Held]) -> list[str]:
    """The files of a checkpoint that hold the model: the replicated one, or one per
    pipeline stage."""
    names = sorted(held)
    stages = [n for n in names if n.startswith(STAGE_PREFIX) and n.endswith(".ckpt")]
    return stages or [n for n in names if n == SHARED]


def _model_state(
    root: Path, step: int, files: list[Held], held: dict[str, Held]
) -> tuple[Any, str]:
    saved = [file.load() for file in files]
    models = [state.get("model") for state in saved]
    if any(model is None for model in models):
        raise ExportError(f"the checkpoint at step {step} in {root} holds no model")
    if isinstance(models[0], list):  # TensorFlow: its variables, in model.variables order
        return tensorflow_arrays(models[0], saved[0].get("model_paths")), "tensorflow"
    if len(files) == 1 and files[0].name == SHARED:
        return own_names(models[0]), "torch"
    names, expected = _stage_layer_names(held)
    if len(files) < expected:
        raise MissingStages(
            f"{len(files)} of the pipeline's {expected} stage files found "
            f"({', '.join(f.name for f in files)}) here and under {root.parent / 'nodes'}"
        )
    names = names or _partition_layer_names(root)
    if not names:
        raise ExportError(
            f"the checkpoint at step {step} in {root} does not name its pipeline "
            "layers (written before overlapkit recorded them, and no pipeline-partition.json "
            "beside it): resume the run for one more checkpoint, then export"
        )
    state: dict[str, Any] = {}
    for model in models:
        for key, value in model.items():
            state[unsplit_name(key, names)] = value
    return state, "torch"


def tensorflow_arrays(variables: list[Any], paths: list[str] | None) -> dict[str, Any]:
    """A TensorFlow model's variables by their Keras paths (``dense/kernel``), in
    ``model.variables`` order; by position (``0000``...) when the checkpoint names
    none (written before overlapkit recorded them) or names one path twice."""
    if paths is not None and len(paths) == len(variables) and len(set(paths)) == len(paths):
        return dict(zip(paths, variables, strict=True))
    return {f"{i:04d}": variable for i, variable in enumerate(variables)}


def own_names(state: dict[str, Any]) -> dict[str, Any]:
    """The names of the model itself: a script's ``torch.compile`` wrapper saves every
    parameter as ``_orig_mod.NAME``, which the model does not load."""
    prefix = "_orig_mod."
    if state and all(key.startswith(prefix) for key in state):
        return {key.removeprefix(prefix): value for key, value in state.items()}
    return state


def _stage_layer_names(held: dict[str, Held]) -> tuple[dict[str, str], int]:
    """Each pipeline layer's name as its stage module names it (dots made underscores)
    -> the model's own name, from the ranks' files; and how many stage files the
    pipeline writes (0 where the files do not say)."""
    names: dict[str, str] = {}
    expected = 0
    for name in sorted(n for n in held if n.startswith("rank")):
        if held[name].problem() is not None:
            continue
        pipeline = held[name].load().get("optimizations", {}).get("pipeline")
        expected = max(expected, (pipeline or {}).get("stage_files", 0))
        for stage in (pipeline or {}).get("stages", []):
            for layer in stage:
                escaped = layer.replace(".", "_")
                if names.setdefault(escaped, layer) != layer:
                    raise ExportError(
                        f"pipeline layers {names[escaped]!r} and {layer!r} have one name in "
                        "their stages' files; name the layers apart in pipeline_layers()"
                    )
    return names, expected


def _partition_layer_names(root: Path) -> dict[str, str]:
    """The same from the partition the run kept in its folder (checkpoints written
    before the ranks' files named the layers)."""
    try:
        layers = json.loads((root.parent / PARTITION_FILE).read_text())["key"]["layers"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    names = {layer.replace(".", "_"): layer for layer in layers}
    return names if len(names) == len(layers) else {}


def unsplit_name(key: str, names: dict[str, str]) -> str:
    """A stage's parameter name as the unsplit model names it:
    ``layers.layer1_0.conv1.weight`` (or ``1.layers...`` with several stages on a
    rank) -> ``layer1.0.conv1.weight``."""
    head, _, rest = key.partition("layers.")
    if head not in ("",) and not (head.endswith(".") and head[:-1].isdigit()):
        raise ExportError(f"a pipeline stage's parameter {key!r} is not a layer's")
    escaped, _, inner = rest.partition(".")
    if escaped not in names:
        raise ExportError(f"a pipeline stage's parameter {key!r} names no recorded layer")
    return f"{names[escaped]}.{inner}" if inner else names[escaped]


def _trained_past(folder: Path, step: int) -> int | None:
    """The steps the run in ``folder`` trained (the last record of its steps.jsonl, or
    of its live-steps.jsonl: a run killed writes no steps.jsonl), when more than
    ``step``; None otherwise, or when its folder does not say."""
    done = max((_steps_logged(folder / name) for name in ("steps.jsonl", LIVE_STEPS)), default=0)
    return done if done > step else None


def _steps_logged(path: Path) -> int:
    """The steps done by the last record of a step log (0: none, or no such log)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (1 << 16)))
            return int(json.loads(f.read().splitlines()[-1])["step"]) + 1
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return 0


def _default_path(folder: Path, root: Path, step: int, framework: str) -> Path:
    suffix = ".npz" if framework == "tensorflow" else ".pt"
    base = folder if folder != root else root.parent
    return base / f"model-step-{step}{suffix}"


def _write(state: Any, framework: str, target: Path, step: int, skipped: list[str]) -> Exported:
    from .runtime.persist import atomic_torch_save, atomic_write

    _check_target(target)
    wanted = (".npz",) if framework == "tensorflow" else (".pt", ".pth")
    if target.suffix in (".npz", ".pt", ".pth") and target.suffix not in wanted:
        what = "a NumPy archive (.npz)" if framework == "tensorflow" else "a torch state_dict"
        raise ExportError(
            f"--to {target}: a {framework} run exports {what}; name it with "
            f"{' or '.join(wanted)} (its loader would not open it under this name)"
        )
    tensors = list(state.values())
    size = sum(t.numel() * t.element_size() for t in tensors)
    try:
        if framework == "tensorflow":
            import io

            import numpy as np

            buffer = io.BytesIO()
            np.savez(buffer, **{key: t.numpy() for key, t in state.items()})
            atomic_write(target, lambda fd: _write_all(fd, buffer.getvalue()))
        else:
            atomic_torch_save(state, target)
    except OSError as error:  # its message named the temporary file beside the target
        raise ExportError(f"{target}: cannot be written ({error.strerror or error})") from None
    by_position = framework == "tensorflow" and "0000" in state
    return Exported(target, step, len(tensors), size, framework, skipped, by_position)


def _check_target(target: Path) -> None:
    """Raise unless ``target`` can be written as a file: a folder holds it."""
    if target.is_dir():
        raise ExportError(f"--to {target}: a folder; name the file to write")
    if target.is_file() and target.stat().st_size and not zipfile.is_zipfile(target):
        raise ExportError(  # both torch.save and NumPy's .npz write zip archives
            f"--to {target}: a file that no export wrote (a run's summary.json, a "
            "checkpoint...): it would be lost; name a new file, or remove it first"
        )
    if not target.parent.is_dir():
        place = nearest_existing(target.parent)
        if place is not None and not place.is_dir():
            raise ExportError(f"--to {target}: {place} is a file; name a file in a folder")
        raise ExportError(f"--to {target}: its folder {target.parent} does not exist")


def _write_all(fd: int, data: bytes) -> None:
    import os

    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]

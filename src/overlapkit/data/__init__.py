"""The built-in datasets, each with a small typed config, chosen by ``data.name``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field
from torch.utils.data import DataLoader, Dataset, Subset

from ..config import Config
from .local import Cifar10, DataError, DataNotFoundError, ImageFolder, Imdb, hash_tokenize
from .sampler import ResumableLoader, ShardedSampler
from .script_loader import ScriptLoader, iterated_note, resume_problem, sampler_note
from .sequence_loader import SEQUENCES, SequenceLoader
from .synthetic import SyntheticImages, SyntheticTokens, spend


class _Synthetic(Config):
    num_samples: int = Field(2048, ge=1)
    eval_samples: int = Field(512, ge=0)
    # per sample, to emulate slow storage or decoding; at most an hour (a sleep's limit is
    # near 292 years: a bigger number is an internal error in the rank)
    sample_cost_ms: float = Field(0.0, ge=0, le=3_600_000)
    sample_cost: Literal["sleep", "cpu"] = "sleep"

    def check(self) -> None:
        """Synthetic data is made on the fly: nothing to look for."""


class SyntheticImagesConfig(_Synthetic):
    name: Literal["synthetic-images"]
    shape: tuple[int, int, int] = (3, 32, 32)
    num_classes: int = Field(10, ge=2)
    signal: float = Field(0.5, ge=0)

    input_kind: ClassVar[str] = "images"

    def build(self, seed: int) -> tuple[Dataset, Dataset | None]:
        def make(count: int, split: int) -> SyntheticImages:
            return SyntheticImages(
                self.shape,
                self.num_classes,
                count,
                seed,
                self.signal,
                self.sample_cost_ms,
                self.sample_cost,
                split,
            )

        return make(self.num_samples, 0), make(self.eval_samples, 1) if self.eval_samples else None


class SyntheticTokensConfig(_Synthetic):
    name: Literal["synthetic-tokens"]
    seq_len: int = Field(128, ge=2)
    vocab_size: int = Field(30522, ge=64)
    num_classes: int = Field(2, ge=2)

    input_kind: ClassVar[str] = "tokens"

    def build(self, seed: int) -> tuple[Dataset, Dataset | None]:
        def make(count: int, split: int) -> SyntheticTokens:
            return SyntheticTokens(
                self.seq_len,
                self.vocab_size,
                self.num_classes,
                count,
                seed,
                self.sample_cost_ms,
                self.sample_cost,
                split,
            )

        return make(self.num_samples, 0), make(self.eval_samples, 1) if self.eval_samples else None


class Cifar10Config(Config):
    name: Literal["cifar10"]
    root: Path

    input_kind: ClassVar[str] = "images"
    num_classes: ClassVar[int] = 10
    shape: ClassVar[tuple[int, int, int]] = (3, 32, 32)

    def check(self) -> None:
        Cifar10.locate(self.root, True)
        Cifar10.locate(self.root, False)

    def build(self, seed: int) -> tuple[Dataset, Dataset | None]:
        return Cifar10(self.root, train=True), Cifar10(self.root, train=False)


class ImageFolderConfig(Config):
    name: Literal["imagefolder"]
    root: Path
    size: int = Field(224, ge=8)

    input_kind: ClassVar[str] = "images"

    def check(self) -> None:
        train = ImageFolder.locate(self.root, "train")
        if self._has_val():
            val = ImageFolder.locate(self.root, "val")
            ImageFolder.check_classes(val, ImageFolder.class_names(train))

    def classes_on_disk(self) -> int:
        """The class folders of the training split (each class a folder)."""
        return len(ImageFolder.class_names(ImageFolder.locate(self.root, "train")))

    def build(self, seed: int) -> tuple[Dataset, Dataset | None]:
        train = ImageFolder(self.root, self.size, split="train")
        if not self._has_val():
            return train, None
        return train, ImageFolder(self.root, self.size, split="val", classes=train.classes)

    def _has_val(self) -> bool:
        return (Path(self.root).expanduser() / "val").is_dir()


class ImdbConfig(Config):
    name: Literal["imdb"]
    root: Path
    seq_len: int = Field(256, ge=2)
    vocab_size: int = Field(30522, ge=64)

    input_kind: ClassVar[str] = "tokens"
    num_classes: ClassVar[int] = 2

    def check(self) -> None:
        Imdb.locate(self.root, True)
        Imdb.locate(self.root, False)

    def build(self, seed: int) -> tuple[Dataset, Dataset | None]:
        return (
            Imdb(self.root, True, self.seq_len, self.vocab_size),
            Imdb(self.root, False, self.seq_len, self.vocab_size),
        )


DataConfig = Annotated[
    SyntheticImagesConfig | SyntheticTokensConfig | Cifar10Config | ImageFolderConfig | ImdbConfig,
    Field(discriminator="name"),
]


def build_loaders(
    train_set: Dataset,
    eval_set: Dataset | None,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    eval_max_samples: int | None = None,
    pin_memory: bool = False,
) -> tuple[ResumableLoader, DataLoader | None]:
    """This rank's training loader (shuffled, resumable) and evaluation shard (in order,
    exact). ``pin_memory`` on a GPU: copies from pinned memory do not stop the host."""
    if len(train_set) < batch_size * world_size:
        raise DataError(
            f"the dataset has {len(train_set)} samples, fewer than one global batch "
            f"({batch_size} per rank x {world_size} ranks)"
        )
    train = ResumableLoader(
        train_set,
        batch_size,
        ShardedSampler(len(train_set), rank, world_size, seed),
        pin_memory=pin_memory,
    )
    if eval_set is None:
        return train, None
    if eval_max_samples is not None and eval_max_samples < len(eval_set):
        eval_set = Subset(eval_set, range(eval_max_samples))
    shard = ShardedSampler(len(eval_set), rank, world_size, shuffle=False, drop_last=False)
    return train, DataLoader(eval_set, batch_size=batch_size, sampler=shard, pin_memory=pin_memory)


__all__ = [
    "Cifar10",
    "DataConfig",
    "DataError",
    "DataNotFoundError",
    "ImageFolder",
    "Imdb",
    "ResumableLoader",
    "SEQUENCES",
    "ScriptLoader",
    "SequenceLoader",
    "ShardedSampler",
    "SyntheticImages",
    "SyntheticTokens",
    "build_loaders",
    "hash_tokenize",
    "iterated_note",
    "resume_problem",
    "sampler_note",
    "spend",
]

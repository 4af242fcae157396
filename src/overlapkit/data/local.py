"""Datasets read from local folders. overlapkit never downloads data: a missing
folder is an error that says what was expected where."""

from __future__ import annotations

import os
import pickle
import re
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from .synthetic import CLS_ID


class DataNotFoundError(FileNotFoundError):
    """A dataset folder is missing or incomplete."""


class DataError(ValueError):
    """A dataset cannot be used as it is: an unreadable file, too few samples."""


def _require(path: Path, what: str, hint: str) -> Path:
    if not path.exists():
        raise DataNotFoundError(
            f"{what} not found at {path}. overlapkit never downloads data: {hint}"
        )
    return path


# ---------------------------------------------------------------- CIFAR-10
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
_CIFAR_HINT = (
    "place the python version of CIFAR-10 (the folder 'cifar-10-batches-py' with "
    "data_batch_1..5 and test_batch) there and set data.root to it or its parent"
)


class _ArrayUnpickler(pickle.Unpickler):
    """Reads CIFAR's pickles, which hold only dicts, lists, bytes and numpy arrays."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset file")


class Cifar10(Dataset):
    """CIFAR-10 from its python pickle folder, normalised per channel."""

    @staticmethod
    def locate(root: str | Path, train: bool = True) -> list[Path]:
        """The batch files of the split; raises `DataNotFoundError` if any is missing."""
        root = _require(Path(root).expanduser(), "CIFAR-10 folder", _CIFAR_HINT)
        folder = root / "cifar-10-batches-py" if (root / "cifar-10-batches-py").is_dir() else root
        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        return [_require(folder / name, "CIFAR-10 file", _CIFAR_HINT) for name in names]

    def __init__(self, root: str | Path, train: bool = True) -> None:
        images, labels = [], []
        for path in self.locate(root, train):
            try:
                with open(path, "rb") as f:
                    batch = _ArrayUnpickler(f, encoding="bytes").load()
                data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
                batch_labels = [int(label) for label in batch[b"labels"]]
            except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as error:
                raise DataError(
                    f"{path} is not a CIFAR-10 batch file ({type(error).__name__}: {error}): "
                    f"{_CIFAR_HINT}"
                ) from None
            images.append(data)
            labels.extend(batch_labels)
        self.images = torch.from_numpy(np.concatenate(images))
        self.labels = torch.tensor(labels)
        self.mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index].float().div_(255)
        return (image - self.mean) / self.std, int(self.labels[index])


# ------------------------------------------------------- ImageNet-style folders
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def _is_image(name: str) -> bool:
    return Path(name).suffix.lower() in IMAGE_EXTENSIONS


class ImageFolder(Dataset):
    """``root/<class>/<image>`` (or ``root/train/...`` and ``root/val/...``):
    decoded with Pillow, shorter side resized to size/0.875, centre-cropped to size."""

    _HINT = "expected one sub-folder of images per class, e.g. root/n01440764/img.jpg"

    @classmethod
    def locate(cls, root: str | Path, split: str | None = None) -> Path:
        root = _require(Path(root).expanduser(), "image folder", cls._HINT)
        if not root.is_dir():
            raise DataNotFoundError(f"{root} is a file, not an image folder: {cls._HINT}")
        root = root / split if split and (root / split).is_dir() else root
        names = cls.class_names(root)
        if not names:
            raise DataNotFoundError(f"no class folders under {root}: {cls._HINT}")
        for name in names:  # an empty one is a class the model would never see
            with os.scandir(root / name) as entries:
                empty = not any(_is_image(entry.name) for entry in entries)
            if empty:
                raise DataNotFoundError(
                    f"the class folder {root / name} holds no image "
                    f"({', '.join(IMAGE_EXTENSIONS)}): {cls._HINT}"
                )
        return root

    @staticmethod
    def class_names(root: Path) -> list[str]:
        return sorted(p.name for p in root.iterdir() if p.is_dir())

    @classmethod
    def check_classes(cls, root: Path, classes: list[str]) -> None:
        """Raise unless the class folders of the split ``root`` are among ``classes``
        (the training split's): a label is its class's place there."""
        extra = [name for name in cls.class_names(root) if name not in classes]
        if extra:
            raise DataNotFoundError(
                f"{root} has class folder(s) the training split lacks: {', '.join(extra[:5])}"
                f"{' ...' if len(extra) > 5 else ''} (a class's folder has the same name in "
                "each split)"
            )

    def __init__(
        self,
        root: str | Path,
        size: int = 224,
        split: str | None = None,
        classes: list[str] | None = None,
    ) -> None:
        """``classes``: the training split's class names, which label this split's
        folders by name (a validation split may lack some of them)."""
        root = self.locate(root, split)
        if classes is not None:
            self.check_classes(root, classes)
        self.classes = self.class_names(root) if classes is None else list(classes)
        label = {name: i for i, name in enumerate(self.classes)}
        self.samples = [
            (path, label[name])
            for name in self.class_names(root)
            for path in sorted((root / name).iterdir())
            if _is_image(path.name)
        ]
        if not self.samples:
            raise DataNotFoundError(f"no images found under {root}: {self._HINT}")
        self.size = size
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        try:
            return self._decode(path), label
        except (OSError, SyntaxError, ValueError) as error:  # Pillow's words for a bad file
            raise DataError(f"cannot read the image {path}: {error}") from None

    def _decode(self, path: Path) -> torch.Tensor:
        with Image.open(path) as image:
            image = image.convert("RGB")
            scale = round(self.size / 0.875) / min(image.size)
            image = image.resize(
                (
                    max(self.size, round(image.width * scale)),
                    max(self.size, round(image.height * scale)),
                ),
                Image.BILINEAR,
            )
            left = (image.width - self.size) // 2
            top = (image.height - self.size) // 2
            image = image.crop((left, top, left + self.size, top + self.size))
            array = np.asarray(image, dtype=np.float32) / 255.0
        tensor = torch.from_numpy(array).permute(2, 0, 1)
        return (tensor - self.mean) / self.std


# --------------------------------------------------------------------- IMDB
_WORD = re.compile(r"[a-z0-9']+")


def hash_tokenize(text: str, seq_len: int, vocab_size: int, first_id: int = 2) -> torch.Tensor:
    """[CLS] + words hashed into [first_id, vocab_size), truncated or padded (0) to seq_len.
    Hashing needs no vocabulary file and is the same on every machine."""
    words = _WORD.findall(text.lower().replace("<br />", " "))[: seq_len - 1]
    ids = [CLS_ID] + [first_id + zlib.crc32(w.encode()) % (vocab_size - first_id) for w in words]
    tokens = torch.zeros(seq_len, dtype=torch.long)
    tokens[: len(ids)] = torch.tensor(ids)
    return tokens


class Imdb(Dataset):
    """The IMDB review folder (``aclImdb/{train,test}/{pos,neg}/*.txt``), label 1 = positive."""

    _HINT = "unpack aclImdb_v1.tar.gz there and set data.root to 'aclImdb' or its parent"

    @classmethod
    def locate(cls, root: str | Path, train: bool = True) -> list[Path]:
        """The split's neg/ and pos/ folders; raises `DataNotFoundError` if missing."""
        root = _require(Path(root).expanduser(), "IMDB folder", cls._HINT)
        root = root / "aclImdb" if (root / "aclImdb").is_dir() else root
        split = _require(root / ("train" if train else "test"), "IMDB split", cls._HINT)
        return [_require(split / name, "IMDB class folder", cls._HINT) for name in ("neg", "pos")]

    def __init__(
        self, root: str | Path, train: bool = True, seq_len: int = 256, vocab_size: int = 30522
    ) -> None:
        self.files = [
            (path, label)
            for label, folder in enumerate(self.locate(root, train))
            for path in sorted(folder.glob("*.txt"))
        ]
        if not self.files:
            raise DataNotFoundError(f"no reviews (*.txt) under {root}: {self._HINT}")
        self.seq_len, self.vocab_size = seq_len, vocab_size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[index]
        text = path.read_text(encoding="utf-8", errors="replace")
        return hash_tokenize(text, self.seq_len, self.vocab_size), label

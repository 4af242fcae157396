"""The built-in models, each with a small typed config, chosen by ``model.name``."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field
from torch import nn

from ..config import Config
from .bert import BertClassifier
from .resnet import ResNet


class ResNetConfig(Config):
    name: Literal["resnet18", "resnet50"]
    stem: Literal["cifar", "imagenet"] = "cifar"
    num_classes: int = Field(10, ge=2)
    width: int = Field(64, ge=4)  # channels after the stem; smaller is faster

    input_kind: ClassVar[str] = "images"

    def build(self) -> nn.Module:
        return ResNet(self.name, self.stem, self.num_classes, self.width)


class BertConfig(Config):
    name: Literal["bert"]
    vocab_size: int = Field(30522, ge=2)
    hidden: int = Field(256, ge=8)
    layers: int = Field(4, ge=1)
    heads: int = Field(4, ge=1)
    intermediate: int | None = Field(None, ge=1)
    max_len: int = Field(512, ge=1)
    num_classes: int = Field(2, ge=2)
    dropout: float = Field(0.1, ge=0, lt=1)

    input_kind: ClassVar[str] = "tokens"

    def build(self) -> nn.Module:
        if self.hidden % self.heads:
            raise ValueError(
                f"model.hidden ({self.hidden}) must be divisible by model.heads ({self.heads})"
            )
        return BertClassifier(
            self.vocab_size,
            self.hidden,
            self.layers,
            self.heads,
            self.intermediate,
            self.max_len,
            self.num_classes,
            self.dropout,
        )


ModelConfig = Annotated[ResNetConfig | BertConfig, Field(discriminator="name")]
MODEL_NAMES = ("resnet18", "resnet50", "bert")

__all__ = ["MODEL_NAMES", "BertClassifier", "BertConfig", "ModelConfig", "ResNet", "ResNetConfig"]

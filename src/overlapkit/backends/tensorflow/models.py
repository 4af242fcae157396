"""The built-in models in Keras layers: ResNet-18/50 (CIFAR and ImageNet stems) and
the BERT-style encoder classifier, the same architectures as `overlapkit.models`.

Keras ships no ResNet-18, and its BERT (keras-hub) needs packages that clash with
tensorflow-cpu, so they are written here. Images are channels-last (TensorFlow's
convolutions on a CPU take no other layout).
"""

from __future__ import annotations

from typing import Any

from ...models import BertConfig, ResNetConfig
from .quiet_keras import keras

layers = keras.layers


# He initialisation by fan-out, as torch's ResNet: the same starting scale. One
# initializer per layer, made after the run's seed is set: an initializer made at
# import would draw its seed before that (and every layer would share it).
def _conv_init() -> keras.initializers.Initializer:
    return keras.initializers.VarianceScaling(2.0, "fan_out", "untruncated_normal")


_BN = {"momentum": 0.9, "epsilon": 1e-5}  # torch's BatchNorm2d: momentum 0.1, eps 1e-5
_STAGES = {"resnet18": ("basic", (2, 2, 2, 2)), "resnet50": ("bottleneck", (3, 4, 6, 3))}


def _conv(filters: int, size: int, stride: int = 1) -> layers.Layer:
    return layers.Conv2D(
        filters, size, stride, padding="same", use_bias=False, kernel_initializer=_conv_init()
    )


def _bn(zero: bool = False) -> layers.Layer:
    # The last batch norm of a residual branch starts at zero: each block starts as identity.
    return layers.BatchNormalization(**_BN, gamma_initializer="zeros" if zero else "ones")


def _block(x: Any, planes: int, stride: int, kind: str) -> Any:
    expansion = 4 if kind == "bottleneck" else 1
    if kind == "basic":
        out = layers.ReLU()(_bn()(_conv(planes, 3, stride)(x)))
        out = _bn(zero=True)(_conv(planes, 3)(out))
    else:
        out = layers.ReLU()(_bn()(_conv(planes, 1)(x)))
        out = layers.ReLU()(_bn()(_conv(planes, 3, stride)(out)))
        out = _bn(zero=True)(_conv(planes * expansion, 1)(out))
    shortcut = x
    if stride != 1 or x.shape[-1] != planes * expansion:
        shortcut = _bn()(_conv(planes * expansion, 1, stride)(x))
    return layers.ReLU()(layers.Add()([out, shortcut]))


def resnet(cfg: ResNetConfig, shape: tuple[int, int, int]) -> keras.Model:
    """``shape``: one image, channels first (as the datasets yield it)."""
    channels, height, width = shape
    inputs = keras.Input((height, width, channels))
    if cfg.stem == "cifar":
        x = layers.ReLU()(_bn()(_conv(cfg.width, 3)(inputs)))
    else:
        x = layers.ReLU()(_bn()(_conv(cfg.width, 7, 2)(inputs)))
        x = layers.MaxPooling2D(3, 2, padding="same")(x)
    kind, counts = _STAGES[cfg.name]
    for i, count in enumerate(counts):
        for j in range(count):
            x = _block(x, cfg.width * 2**i, 2 if (i > 0 and j == 0) else 1, kind)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(cfg.num_classes)(x), name=cfg.name)


class _Embeddings(layers.Layer):
    """Token plus learned position embeddings, then layer norm and dropout."""

    def __init__(self, cfg: BertConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tokens = layers.Embedding(cfg.vocab_size, cfg.hidden)
        self.positions = layers.Embedding(cfg.max_len, cfg.hidden)
        self.norm = layers.LayerNormalization(epsilon=1e-5)
        self.dropout = layers.Dropout(cfg.dropout)

    def call(self, tokens: Any, training: bool = False) -> Any:
        positions = keras.ops.arange(keras.ops.shape(tokens)[1])
        x = self.tokens(tokens) + self.positions(positions)[None]
        return self.dropout(self.norm(x), training=training)


class _EncoderLayer(layers.Layer):
    """Post-norm Transformer layer, GELU feed-forward (as torch's `EncoderLayer`)."""

    def __init__(self, cfg: BertConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        heads, hidden = cfg.heads, cfg.hidden
        self.attention = layers.MultiHeadAttention(heads, hidden // heads, dropout=cfg.dropout)
        self.norm1 = layers.LayerNormalization(epsilon=1e-5)
        self.up = layers.Dense(cfg.intermediate or 4 * hidden, activation="gelu")
        self.down = layers.Dense(hidden)
        self.norm2 = layers.LayerNormalization(epsilon=1e-5)
        self.dropout = layers.Dropout(cfg.dropout)

    def call(self, x: Any, mask: Any, training: bool = False) -> Any:
        attended = self.attention(x, x, attention_mask=mask, training=training)
        x = self.norm1(x + self.dropout(attended, training=training))
        return self.norm2(x + self.dropout(self.down(self.up(x)), training=training))


class BertClassifier(keras.Model):
    """Token ids (batch, seq) -> class logits, pooled from the first token; token id 0
    is padding and is masked out of attention."""

    def __init__(self, cfg: BertConfig, **kwargs: Any) -> None:
        super().__init__(name="bert", **kwargs)
        # Named: Keras names a layer after its class, and a name starting with "_" is no
        # valid root scope when the model is called outside strategy.run (evaluation).
        self.embeddings = _Embeddings(cfg, name="embeddings")
        self.encoder = [_EncoderLayer(cfg, name=f"encoder_{i}") for i in range(cfg.layers)]
        self.pooler = layers.Dense(cfg.hidden, activation="tanh")
        self.classifier = layers.Dense(cfg.num_classes)

    def call(self, tokens: Any, training: bool = False) -> Any:
        mask = keras.ops.expand_dims(keras.ops.not_equal(tokens, 0), 1)  # (batch, 1, seq)
        x = self.embeddings(tokens, training=training)
        for layer in self.encoder:
            x = layer(x, mask, training=training)
        return self.classifier(self.pooler(x[:, 0]))


def build_model(cfg: ResNetConfig | BertConfig, sample_shape: tuple[int, ...]) -> keras.Model:
    """The Keras model for ``cfg``, built (its variables exist) for samples of
    ``sample_shape`` (an image channels first, or a sequence of token ids)."""
    if isinstance(cfg, ResNetConfig):
        return resnet(cfg, sample_shape)
    if cfg.hidden % cfg.heads:
        raise ValueError(
            f"model.hidden ({cfg.hidden}) must be divisible by model.heads ({cfg.heads})"
        )
    model = BertClassifier(cfg)
    model(keras.ops.ones((1, *sample_shape), dtype="int32"))
    return model

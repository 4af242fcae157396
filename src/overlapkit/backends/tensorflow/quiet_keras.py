"""Keras, imported after TensorFlow is imported quietly (`import_tensorflow`: with
its log level set, and without the lines its start-up writes before logging starts).
Keras imports TensorFlow at import: the back end's modules take it from here."""

from __future__ import annotations

from . import import_tensorflow

import_tensorflow()
import keras  # noqa: E402

__all__ = ["keras"]

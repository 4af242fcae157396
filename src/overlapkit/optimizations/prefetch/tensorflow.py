"""``prefetch`` on TensorFlow: the same knobs on the training loop's tf.data pipeline.

``workers`` batches are loaded at once by a parallel map, ``depth`` batches are
kept ahead by ``prefetch``, and on a GPU TensorFlow sees, ``device_depth``
batches wait on it already (``prefetch_to_device``); ``autotune`` hands the
parallelism and depth to tf.data. Intensity 0 loads each batch when the step
asks for it, as without the optimization.
"""

from __future__ import annotations

from typing import Any

from ...backends.tensorflow.data import InputPlan
from ...runtime.optimization import settings_on
from .optimization import Prefetch


class TfPrefetch:
    name = Prefetch.name

    def __init__(self, optimization: Prefetch) -> None:
        self.optimization = optimization

    def input_plan(self) -> InputPlan:
        s = self.optimization.settings
        return InputPlan(s["workers"], s["depth"], s["device_depth"], s["autotune"])

    def shown_settings(self, device: str) -> dict[str, Any]:
        """The settings as they run: tf.data's, whatever backend's default says; with
        autotune, tf.data picks the parallelism and depth, not workers and depth."""
        shown = {**settings_on(self.optimization, "tensorflow"), "backend": "tfdata"}
        if shown["autotune"]:
            shown["workers"] = shown["depth"] = "tf.data's (autotune)"
        for knob in self.idle_knobs(device):
            shown[knob] = "n/a (no GPU)"
        return shown

    @staticmethod
    def idle_knobs(device: str) -> dict[str, str]:
        """The knobs that do nothing on ``device``, and why (not searched by tune)."""
        if device == "cuda":
            return {}
        return {"device_depth": "prefetch_to_device needs a GPU (tf.data's prefetch holds them)"}

    def summary(self, run: dict[str, Any]) -> dict[str, Any]:
        shown = self.shown_settings(run["strategy"]["device"])
        return {**shown, "data_wait_s": run["phases_s"]["data_wait"]}


def engine(optimization: Prefetch) -> TfPrefetch:
    return TfPrefetch(optimization)

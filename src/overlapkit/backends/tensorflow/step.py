"""The compiled training step: forward, backward, gradient all-reduce and optimizer
update in one ``strategy.run`` inside one ``tf.function``; and the evaluation step.

Gradients are all-reduced by Keras's optimizer through the strategy, in packs of
the strategy's ``bytes_per_pack`` (see the ``ddp_overlap`` engine). Batch-norm
statistics are averaged across replicas after each update in one more
collective, so every replica holds the same model (torch's DDP broadcasts rank
0's buffers instead); its own pack size is 0, so it is always one collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...runtime.loop import OptimizerConfig, TrainConfig, lr_factor
from .quiet_keras import keras

PRECISION_POLICY = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


class _TableSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The learning rate at each optimizer step, from the same factors as torch's loop."""

    def __init__(self, base: float, factors: np.ndarray) -> None:
        self.base, self.factors = base, factors

    def __call__(self, step: Any) -> Any:
        import tensorflow as tf

        table = tf.constant(self.factors, tf.float32)
        index = tf.minimum(tf.cast(step, tf.int32), len(self.factors) - 1)
        return self.base * tf.gather(table, index)

    def get_config(self) -> dict[str, Any]:
        return {"base": self.base, "factors": self.factors.tolist()}


def build_optimizer(cfg: TrainConfig) -> keras.optimizers.Optimizer:
    """Keras's optimizer for ``cfg``. Weight decay as torch applies it: added to the
    gradient for sgd and adam (see `coupled_decay`), decoupled for adamw."""
    opt: OptimizerConfig = cfg.optimizer
    schedule = cfg.lr_schedule
    if schedule.name == "constant" and not schedule.warmup_steps:
        lr: Any = opt.lr
    else:
        factor = lr_factor(schedule, cfg.total_steps)
        lr = _TableSchedule(opt.lr, np.array([factor(s) for s in range(cfg.total_steps)]))
    if opt.name == "sgd":
        return keras.optimizers.SGD(lr, momentum=opt.momentum, nesterov=opt.nesterov)
    beta_1, beta_2 = opt.betas
    if opt.name == "adam":
        return keras.optimizers.Adam(lr, beta_1=beta_1, beta_2=beta_2, epsilon=1e-8)
    return keras.optimizers.AdamW(
        lr, weight_decay=opt.weight_decay, beta_1=beta_1, beta_2=beta_2, epsilon=1e-8
    )


def coupled_decay(cfg: OptimizerConfig) -> float:
    return cfg.weight_decay if cfg.name in ("sgd", "adam") else 0.0


def buffers(model: keras.Model) -> list[Any]:
    """The model's float variables that training changes outside the gradient
    (batch-norm statistics), not the dropout seeds' states."""
    return [
        v
        for v in model.non_trainable_variables
        if v.dtype.startswith("float") and "seed_generator" not in v.path
    ]


def make_train_step(
    tf: Any,
    strategy: Any,
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    cfg: TrainConfig,
    global_batch: int,
) -> Callable[[Any, Any], Any]:
    """``step(inputs, targets)`` -> this replica's mean loss on its batch."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    decay = coupled_decay(cfg.optimizer)
    synced = buffers(model) if strategy.num_replicas_in_sync > 1 else []
    one_pack = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=0)
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def replica_step(inputs: Any, targets: Any) -> Any:
        variables = model.trainable_variables
        with tf.GradientTape() as tape:
            logits = tf.cast(model(inputs, training=True), tf.float32)
            loss = tf.reduce_sum(loss_fn(targets, logits)) / global_batch
            to_differentiate = optimizer.scale_loss(loss) if scaled else loss
        grads = tape.gradient(to_differentiate, variables)
        if decay:
            grads = [
                g + decay * tf.cast(v.value, g.dtype) for g, v in zip(grads, variables, strict=True)
            ]
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        if synced:
            context = tf.distribute.get_replica_context()
            means = context.all_reduce(
                tf.distribute.ReduceOp.MEAN,
                [tf.identity(v.value) for v in synced],
                options=one_pack,
            )
            for variable, mean in zip(synced, means, strict=True):
                variable.assign(mean)
        return loss * strategy.num_replicas_in_sync  # this replica's own mean

    @tf.function
    def train_step(inputs: Any, targets: Any) -> Any:
        per_replica = strategy.run(replica_step, args=(inputs, targets))
        return strategy.experimental_local_results(per_replica)[0]

    return train_step


def make_eval_step(tf: Any, model: keras.Model) -> Callable[[Any, Any], Any]:
    """``step(inputs, targets)`` -> (correct predictions, summed loss) on this rank's batch."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    @tf.function
    def eval_step(inputs: Any, targets: Any) -> Any:
        logits = tf.cast(model(inputs, training=False), tf.float32)
        correct = tf.reduce_sum(tf.cast(tf.argmax(logits, -1) == targets, tf.int64))
        return correct, tf.reduce_sum(loss_fn(targets, logits))

    return eval_step


def collectives_in(function: Any, *args: Any) -> dict[str, int]:
    """The collective ops one call of the compiled ``function`` on ``args`` runs, by
    type: read from its graph (and the functions it calls), not assumed. Dense
    gradients are all-reduced by ``CollectiveReduceV2`` (one per pack); sparse ones
    (embeddings) are all-gathered."""
    counts: dict[str, int] = {}

    def count(g: Any) -> None:
        for op in g.get_operations():
            if op.type.startswith("Collective"):
                counts[op.type] = counts.get(op.type, 0) + 1
        for fn in getattr(g, "_functions", {}).values():
            inner = getattr(fn, "graph", None)
            if inner is not None:
                count(inner)

    count(function.get_concrete_function(*args).graph)
    return counts

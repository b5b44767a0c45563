"""Losses and evaluation per task, connecting a dataset's batches to a zoo model.

A Task turns one worker's batch into inputs, targets, the loss and evaluation sums.
classification: cross-entropy and accuracy; causal_lm: next-token loss and perplexity.
span_qa: BERT's SQuAD loss; evaluation scores exact match and F1 on the host.
Details: docs/design.md, "Tasks (train/tasks.py)".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from resireduce_jax.models import scan

__all__ = ["TASKS", "CausalLM", "Classification", "SpanQA", "Task", "make_task"]

DATASET_TASK = {
    "classification": "classification",
    "language_modeling": "causal_lm",
    "span_qa": "span_qa",
}


@dataclasses.dataclass(frozen=True)
class Task:
    """A model (with its zoo configuration) trained on one kind of batch.

    Subclasses (one per :attr:`kind`, registered in :data:`TASKS`) say how a batch splits
    into inputs and targets, the loss and training metrics, the per-batch eval sums and
    the final metrics; applying the model is shared.
    """

    model: nn.Module
    model_config: Any

    #: The model configuration's ``task`` this class serves.
    kind: ClassVar[str]

    # ------------------------------------------------------------------ inputs

    def split(self, batch: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], Any]:
        """``(model inputs, targets)`` of a dataset batch."""
        raise NotImplementedError

    def example_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return self.split(batch)[0]

    # ------------------------------------------------------------------ training

    def init(self, key: jax.Array, batch: dict[str, Any]) -> dict[str, Any]:
        """The model's variables for ``key``.

        A model scanned over its layers (``scan_layers``) starts from the variables of the
        same model written out, stacked (:func:`resireduce_jax.models.scan.stack_layers`):
        a scanned run and a written-out run of one seed start from the same weights.
        """
        inputs = self.example_inputs(batch)
        config = self.model_config
        if not getattr(config, "scan_layers", False):
            return self.model.init(key, **inputs)
        written_out = dataclasses.replace(config, scan_layers=False).build()
        variables = dict(written_out.init(key, **inputs))
        variables["params"] = scan.stack_layers(
            variables["params"], config.layer_scope, config.num_layers
        )
        return variables

    def loss(self, params, model_state, batch, rng):
        """Per-worker loss; returns ``(loss, (new_model_state, metrics))``."""
        inputs, targets = self.split(batch)
        variables = {"params": params, **model_state}
        mutable = [c for c in self.model_config.mutable_collections if c in model_state]
        rngs = {
            name: jax.random.fold_in(rng, i) for i, name in enumerate(self.model_config.rng_names)
        }
        out = self.model.apply(variables, **inputs, train=True, rngs=rngs, mutable=mutable or False)
        outputs, new_state = out if mutable else (out, {})
        new_model_state = {**model_state, **new_state}
        loss, metrics = self.loss_and_metrics(outputs, targets)
        return loss, (new_model_state, metrics)

    def loss_and_metrics(self, outputs, targets) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The scalar loss and the training metrics of one batch's outputs."""
        raise NotImplementedError

    # ------------------------------------------------------------------ evaluation

    def eval_outputs(self, params, model_state, batch):
        """Sums over this worker's eval rows (masked), or logits for span QA."""
        inputs, targets = self.split(batch)
        outputs = self.model.apply({"params": params, **model_state}, **inputs, train=False)
        return self.eval_sums(outputs, targets, batch["mask"].astype(jnp.float32))

    def eval_sums(self, outputs, targets, mask: jax.Array) -> dict[str, jax.Array]:
        """What :meth:`eval_outputs` returns for one batch (``mask``: 1 for real rows)."""
        raise NotImplementedError

    @classmethod
    def metrics(cls, sums: dict[str, float]) -> dict[str, float]:
        """Final eval metrics from eval outputs summed over workers and batches."""
        raise NotImplementedError

    @staticmethod
    def summarize(kind: str, sums: dict[str, float]) -> dict[str, float]:
        """Final eval metrics of a task ``kind`` (:meth:`metrics` of its class)."""
        return TASKS[kind].metrics(sums)


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


@dataclasses.dataclass(frozen=True)
class Classification(Task):
    """Softmax cross-entropy; eval: correct predictions and loss."""

    kind: ClassVar[str] = "classification"

    def split(self, batch):
        return {self.model_config.input_names[0]: batch["image"]}, batch["label"]

    def loss_and_metrics(self, outputs, targets):
        loss = _cross_entropy(outputs, targets).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(outputs, -1) == targets)}

    def eval_sums(self, outputs, targets, mask):
        correct = (jnp.argmax(outputs, -1) == targets).astype(jnp.float32)
        return {
            "correct": jnp.sum(correct * mask),
            "loss_sum": jnp.sum(_cross_entropy(outputs, targets) * mask),
            "count": jnp.sum(mask),
        }

    @classmethod
    def metrics(cls, sums):
        count = max(sums["count"], 1)
        return {"accuracy": sums["correct"] / count, "loss": sums["loss_sum"] / count}


@dataclasses.dataclass(frozen=True)
class CausalLM(Task):
    """Next-token cross-entropy; eval: summed NLL and token count, giving perplexity."""

    kind: ClassVar[str] = "causal_lm"

    def split(self, batch):
        tokens = batch["tokens"]
        return {"tokens": tokens[:, :-1]}, tokens[:, 1:]

    def loss_and_metrics(self, outputs, targets):
        loss = _cross_entropy(outputs, targets).mean()
        return loss, {"perplexity": jnp.exp(loss)}

    def eval_sums(self, outputs, targets, mask):
        losses = _cross_entropy(outputs, targets)
        return {
            "loss_sum": jnp.sum(losses * mask[:, None]),
            "count": jnp.sum(mask) * losses.shape[1],
        }

    @classmethod
    def metrics(cls, sums):
        loss = sums["loss_sum"] / max(sums["count"], 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 80.0))}


@dataclasses.dataclass(frozen=True)
class SpanQA(Task):
    """Mean of start and end cross-entropies (BERT's SQuAD loss).

    Eval returns the logits, scored on the host with SQuAD's exact match and F1.
    """

    kind: ClassVar[str] = "span_qa"

    def split(self, batch):
        inputs = {k: batch[k] for k in self.model_config.input_names}
        return inputs, (batch["start_positions"], batch["end_positions"])

    def loss_and_metrics(self, outputs, targets):
        (start_logits, end_logits), (start, end) = outputs, targets
        loss = 0.5 * (
            _cross_entropy(start_logits, start).mean() + _cross_entropy(end_logits, end).mean()
        )
        return loss, {}

    def eval_sums(self, outputs, targets, mask):
        return {"start_logits": outputs[0], "end_logits": outputs[1]}

    @classmethod
    def metrics(cls, sums):
        count = max(sums["count"], 1)
        return {"exact_match": 100 * sums["sum_em"] / count, "f1": 100 * sums["sum_f1"] / count}


#: The task class of each model configuration's ``task``.
TASKS: dict[str, type[Task]] = {cls.kind: cls for cls in (Classification, CausalLM, SpanQA)}


def make_task(model: nn.Module, model_config: Any, dataset_task: str) -> Task:
    """The task for a zoo model on a dataset; refuses mismatched pairs clearly."""
    kind = DATASET_TASK.get(dataset_task)
    if kind is None or kind != model_config.task:
        raise ValueError(
            f"The model predicts '{model_config.task}' but the dataset provides "
            f"'{dataset_task}' batches; pick a model and dataset of the same task."
        )
    return TASKS[kind](model=model, model_config=model_config)

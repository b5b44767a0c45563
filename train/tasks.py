"""Losses and evaluation per task, connecting a dataset's batches to a zoo model.

A :class:`Task` knows how to turn one worker's batch into the model's inputs and targets,
the training loss (with BatchNorm statistics and dropout where the model has them), and
the per-batch evaluation sums that are added over workers and batches:

* ``classification``: softmax cross-entropy; eval: correct predictions and loss.
* ``causal_lm``: next-token cross-entropy; eval: summed negative log-likelihood and the
  number of predicted tokens, giving perplexity ``exp(nll / tokens)``.
* ``span_qa``: mean of start and end cross-entropies (BERT's SQuAD loss); eval returns
  the logits, scored on the host with SQuAD's exact match and F1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

__all__ = ["Task", "make_task"]

DATASET_TASK = {
    "classification": "classification",
    "language_modeling": "causal_lm",
    "span_qa": "span_qa",
}


@dataclasses.dataclass(frozen=True)
class Task:
    """A model (with its zoo configuration) trained on one kind of batch."""

    model: nn.Module
    model_config: Any
    kind: str

    # ------------------------------------------------------------------ inputs

    def split(self, batch: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], Any]:
        """``(model inputs, targets)`` of a dataset batch."""
        if self.kind == "causal_lm":
            tokens = batch["tokens"]
            return {"tokens": tokens[:, :-1]}, tokens[:, 1:]
        if self.kind == "classification":
            return {self.model_config.input_names[0]: batch["image"]}, batch["label"]
        inputs = {k: batch[k] for k in self.model_config.input_names}
        return inputs, (batch["start_positions"], batch["end_positions"])

    def example_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return self.split(batch)[0]

    # ------------------------------------------------------------------ training

    def init(self, key: jax.Array, batch: dict[str, Any]) -> dict[str, Any]:
        return self.model.init(key, **self.example_inputs(batch))

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
        loss, metrics = self._loss_and_metrics(outputs, targets)
        return loss, (new_model_state, metrics)

    def _loss_and_metrics(self, outputs, targets):
        if self.kind == "span_qa":
            start_logits, end_logits = outputs
            start, end = targets
            loss = 0.5 * (
                optax.softmax_cross_entropy_with_integer_labels(start_logits, start).mean()
                + optax.softmax_cross_entropy_with_integer_labels(end_logits, end).mean()
            )
            return loss, {}
        losses = optax.softmax_cross_entropy_with_integer_labels(outputs, targets)
        loss = losses.mean()
        if self.kind == "classification":
            accuracy = jnp.mean(jnp.argmax(outputs, -1) == targets)
            return loss, {"accuracy": accuracy}
        return loss, {"perplexity": jnp.exp(loss)}

    # ------------------------------------------------------------------ evaluation

    def eval_outputs(self, params, model_state, batch):
        """Sums over this worker's eval rows (masked), or logits for span QA."""
        inputs, targets = self.split(batch)
        outputs = self.model.apply({"params": params, **model_state}, **inputs, train=False)
        mask = batch["mask"].astype(jnp.float32)
        if self.kind == "span_qa":
            return {"start_logits": outputs[0], "end_logits": outputs[1]}
        losses = optax.softmax_cross_entropy_with_integer_labels(outputs, targets)
        if self.kind == "classification":
            correct = (jnp.argmax(outputs, -1) == targets).astype(jnp.float32)
            return {
                "correct": jnp.sum(correct * mask),
                "loss_sum": jnp.sum(losses * mask),
                "count": jnp.sum(mask),
            }
        return {
            "loss_sum": jnp.sum(losses * mask[:, None]),
            "count": jnp.sum(mask) * losses.shape[1],
        }

    @staticmethod
    def summarize(kind: str, sums: dict[str, float]) -> dict[str, float]:
        """Final eval metrics from summed eval outputs."""
        if kind == "span_qa":
            count = max(sums["count"], 1)
            return {"exact_match": 100 * sums["sum_em"] / count, "f1": 100 * sums["sum_f1"] / count}
        count = max(sums["count"], 1)
        loss = sums["loss_sum"] / count
        if kind == "classification":
            return {"accuracy": sums["correct"] / count, "loss": loss}
        return {"loss": loss, "perplexity": math.exp(min(loss, 80.0))}


def make_task(model: nn.Module, model_config: Any, dataset_task: str) -> Task:
    """The task for a zoo model on a dataset; refuses mismatched pairs clearly."""
    kind = DATASET_TASK.get(dataset_task)
    if kind is None or kind != model_config.task:
        raise ValueError(
            f"The model predicts '{model_config.task}' but the dataset provides "
            f"'{dataset_task}' batches; pick a model and dataset of the same task."
        )
    return Task(model=model, model_config=model_config, kind=kind)

"""Checkpoints with orbax: the whole train state, per-worker residuals included.

A checkpoint holds step, params, optimizer state and model state, plus a JSON record.
Orbax renames a checkpoint into place only when complete, behind a commit marker.
A step directory without the marker is moved aside to <step>.uncommitted.
A change of workers or devices per node follows on_worker_change: "error" or "average".
The state is written with its own orbax handler: each replicated array from one device.
The layouts, the averaging and the handler: docs/design.md, "Checkpoints
(train/checkpointing.py)".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any
log = logging.getLogger(__name__)

__all__ = [
    "COMMIT_MARKER",
    "Checkpointer",
    "WorkerCountMismatch",
    "committed_steps",
    "is_committed",
    "latest_complete_step",
    "mean_per_worker",
]

COMMIT_MARKER = "commit_success.txt"


def state_handler() -> ocp.PyTreeCheckpointHandler:
    """The handler of the train state: orbax's default type handlers, except that a
    replicated ``jax.Array`` is written from one device, not split over its replicas."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (int, ocp.type_handlers.ScalarHandler()),
        (float, ocp.type_handlers.ScalarHandler()),
        (bytes, ocp.type_handlers.ScalarHandler()),
        (np.number, ocp.type_handlers.ScalarHandler()),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)),
        (str, ocp.type_handlers.StringHandler()),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def handler_registry(
    state: ocp.handlers.CheckpointHandler, save: type, restore: type
) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """The handlers of every item a checkpoint holds: the train state (``state``, written
    and read with the argument types ``save`` and ``restore``) and its JSON ``meta``.
    A manager without a handler for an item it finds logs a warning at every read."""
    handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
    handlers.add("state", save, state)
    handlers.add("state", restore, state)
    meta = ocp.JsonCheckpointHandler()
    handlers.add("meta", ocp.args.JsonSave, meta)
    handlers.add("meta", ocp.args.JsonRestore, meta)
    return handlers


class WorkerCountMismatch(ValueError):
    """A checkpoint written with a different number of workers (or devices per node), and
    policy ``"error"``."""


def _layout(num_workers: int, local_devices: int | None) -> str:
    """``"8 workers"``, or ``"8 workers as 2 nodes x 4 devices (local_devices=4)"``."""
    if not local_devices:
        return f"{num_workers} workers"
    nodes = num_workers // local_devices
    per_node = f"{local_devices} devices (local_devices={local_devices})"
    return f"{num_workers} workers as {nodes} nodes x {per_node}"


def _layout_flags(num_workers: int, local_devices: int | None) -> str:
    local = f"--config.local_devices={local_devices}" if local_devices else "local_devices unset"
    return f"--config.num_workers={num_workers} and {local}"


def _is_per_worker(spec: Any) -> bool:
    return isinstance(spec, P) and spec != P()


def _place(x: np.ndarray, mesh, spec: P) -> jax.Array:
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def mean_per_worker(
    opt_state: PyTree, specs: PyTree, num_workers: int, saved_local_devices: int | None = None
) -> PyTree:
    """Every per-worker leaf becomes its mean over the old workers, repeated per new worker.

    Refuses integer per-worker leaves (e.g. the row indices of ResiReduce's compressed
    residuals): they cannot be averaged; pass a ``redistribute`` that understands them.
    Shapes are kept, so residuals sharded for another ``saved_local_devices`` need such a
    ``redistribute`` too (:meth:`Checkpointer.restore` says so).
    """
    del saved_local_devices

    def leaf(x, spec):
        if not _is_per_worker(spec):
            return x
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(
                f"A per-worker state leaf of dtype {x.dtype} and shape {x.shape} cannot be "
                "averaged over workers."
            )
        mean = x.astype(np.promote_types(x.dtype, np.float32)).mean(0).astype(x.dtype)
        return np.ascontiguousarray(np.broadcast_to(mean, (num_workers, *mean.shape)))

    return jax.tree.map(leaf, opt_state, specs)


def _metadata_key(key: Any) -> Any:
    """A pytree path entry as orbax's metadata tree indexes it (names and dict keys)."""
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.DictKey):
        return key.key
    if isinstance(key, jax.tree_util.SequenceKey):
        return key.idx
    return key


def _check_shapes(host: PyTree, like: PyTree, specs: PyTree, old: str, new: str) -> None:
    """Raises ValueError if redistributed per-worker leaves are not shaped for this run."""

    def check(x, a, s):
        if _is_per_worker(s) and tuple(np.shape(x)) != tuple(a.shape):
            raise ValueError(
                f"Redistributing per-worker state written by {old} to {new} gave shape "
                f"{np.shape(x)} where this run needs {a.shape}: pass a redistribute function "
                "that knows the residual layout (train.train.worker_redistribution)."
            )

    jax.tree.map(check, host, like, specs)


def is_committed(step_dir: str) -> bool:
    """Whether orbax finished writing ``step_dir`` (it holds the commit marker)."""
    return os.path.isfile(os.path.join(step_dir, COMMIT_MARKER))


def committed_steps(directory: str) -> list[int]:
    """The steps in ``directory`` whose checkpoint orbax finished writing, ascending."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        int(name)
        for name in os.listdir(directory)
        if name.isdigit() and is_committed(os.path.join(directory, name))
    )


def latest_complete_step(directory: str, steps) -> int | None:
    """The newest of ``steps`` (orbax's listing of ``directory``) that is committed."""
    complete = [s for s in steps if is_committed(os.path.join(directory, str(s)))]
    return max(complete) if complete else None


def _set_aside_uncommitted(directory: str) -> None:
    """Renames ``<step>`` directories without the commit marker to ``<step>.uncommitted``."""
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.isdigit() and os.path.isdir(path) and not is_committed(path):
            aside = f"{path}.uncommitted"
            suffix = 1
            while os.path.exists(aside):
                aside, suffix = f"{path}.uncommitted{suffix}", suffix + 1
            log.warning(
                "Checkpoint directory %s has no %s: it was not completely written. Moved it "
                "to %s; resuming from an older checkpoint.",
                path,
                COMMIT_MARKER,
                aside,
            )
            os.rename(path, aside)


class Checkpointer:
    """Saves and restores train states in ``directory`` (one sub-directory per step)."""

    def __init__(
        self,
        directory: str,
        *,
        keep: int,
        num_workers: int,
        on_worker_change: str,
        local_devices: int | None = None,
    ):
        self.directory = os.path.abspath(directory)
        self.num_workers = num_workers
        self.local_devices = local_devices or None  # 0 and None: the flat exchange
        self.on_worker_change = on_worker_change
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ValueError(f"Checkpoint path {self.directory} exists and is not a directory.")
        if jax.process_index() == 0:
            _set_aside_uncommitted(self.directory)
        if jax.process_count() > 1:  # the others list the directory after the clean-up
            multihost_utils.sync_global_devices("resireduce_checkpoints_listed")
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            handler_registry=handler_registry(
                state_handler(), ocp.args.PyTreeSave, ocp.args.PyTreeRestore
            ),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None``."""
        return self._manager.latest_step()

    def save(self, step: int, state: PyTree, state_specs: PyTree, *, wait: bool = False) -> None:
        """Writes ``state`` at ``step`` (asynchronously unless ``wait``)."""
        per_worker = [
            jax.tree_util.keystr(path)
            for path, spec in jax.tree_util.tree_flatten_with_path(
                state_specs, is_leaf=lambda x: isinstance(x, P)
            )[0]
            if _is_per_worker(spec)
        ]
        meta = {
            "num_workers": self.num_workers,
            "local_devices": self.local_devices,
            "step": int(step),
            "per_worker": per_worker,
        }
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        if wait:
            self._manager.wait_until_finished()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def restore(
        self,
        step: int,
        like: PyTree,
        state_specs: PyTree,
        mesh,
        redistribute: Callable[..., PyTree] | None = None,
    ) -> PyTree:
        """Restores the checkpoint of ``step`` into arrays laid out like ``like``.

        Args:
          step: which checkpoint.
          like: the live train state (or matching ``ShapeDtypeStruct``s with shardings).
          state_specs: PartitionSpecs of ``like["opt_state"]`` (per-worker leaves ``P(axis)``).
          mesh: the current mesh.
          redistribute: for ``on_worker_change="average"``: maps the old optimizer state
            (host arrays, per-worker leaves with ``W_old`` rows, shaped as saved), its specs
            and the new worker count to the new host state, with the keyword
            ``saved_local_devices`` (the checkpoint's devices per node, ``None``: flat).
            Default :func:`mean_per_worker` (same per-worker shapes only).

        Raises:
          WorkerCountMismatch: written by another number of workers or devices per node,
            policy ``"error"``.
          ValueError: the checkpoint is unreadable or does not match this model/optimizer.
        """
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
        except Exception as e:
            raise ValueError(
                f"Checkpoint {step} in {self.directory} is unreadable ({type(e).__name__}: {e}). "
                "Delete that step's directory to resume from an older one, or start a new workdir."
            ) from e
        old_workers = int(meta["num_workers"])
        # Absent from checkpoints written before runs could be hierarchical: a flat layout.
        old_local = meta.get("local_devices") or None
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
        )
        opt_specs = state_specs
        relayout = (old_local or 1) != (self.local_devices or 1)
        changed = old_workers != self.num_workers or relayout
        if changed:
            old, new = (
                _layout(old_workers, old_local),
                _layout(self.num_workers, self.local_devices),
            )
            if self.on_worker_change != "average":
                raise WorkerCountMismatch(
                    f"Checkpoint {step} in {self.directory} was written by {old}; this run has "
                    f"{new}. Per-worker error-feedback residuals"
                    + (
                        " (sharded over a node's devices)"
                        if old_local or self.local_devices
                        else ""
                    )
                    + f" cannot be mapped 1:1. Run with {_layout_flags(old_workers, old_local)}, "
                    "or set --config.on_worker_change=average to give every worker the old "
                    "workers' mean residual (the pending global update is kept)."
                )
            log.warning(
                "Checkpoint %d was written by %s, this run has %s: per-worker state "
                "(residuals) is replaced by its mean over the old workers.",
                step,
                old,
                new,
            )
            replicated = NamedSharding(mesh, P())
            saved_shapes = self._saved_shapes(step, abstract["opt_state"], opt_specs, old_workers)
            abstract["opt_state"] = jax.tree.map(
                lambda a, s, shape: (
                    jax.ShapeDtypeStruct(shape, a.dtype, sharding=replicated)
                    if _is_per_worker(s)
                    else a
                ),
                abstract["opt_state"],
                opt_specs,
                saved_shapes,
            )
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item=abstract,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                    )
                ),
            )["state"]
        except Exception as e:
            raise ValueError(
                f"Checkpoint {step} in {self.directory} does not match this run's model, "
                f"optimizer or compression settings ({type(e).__name__}: {e}). Use the same "
                "config as the run that wrote it, or a new workdir."
            ) from e
        if changed:
            host = jax.tree.map(
                lambda x, s: np.asarray(x) if _is_per_worker(s) else x,
                restored["opt_state"],
                opt_specs,
            )
            host = (redistribute or mean_per_worker)(
                host, opt_specs, self.num_workers, saved_local_devices=old_local
            )
            _check_shapes(host, like["opt_state"], opt_specs, old, new)
            restored["opt_state"] = jax.tree.map(
                lambda x, s: _place(x, mesh, s) if _is_per_worker(s) else x, host, opt_specs
            )
        return restored

    def _saved_shapes(self, step: int, abstract: PyTree, specs: PyTree, old_workers: int) -> PyTree:
        """The shapes the checkpoint holds for the leaves of ``abstract`` (the optimizer
        state): per-worker leaves may be shaped by the old layout (sharded residuals).
        Leaves its metadata does not show: ``old_workers`` rows of this run's shape."""
        handler = state_handler()
        try:
            path = epath.Path(self.directory) / str(step) / "state"
            metadata = handler.metadata(path)["opt_state"]
        finally:
            handler.close()
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        shapes = []
        for (path, leaf), spec in zip(flat, treedef.flatten_up_to(specs), strict=True):
            node = metadata
            try:
                for key in path:
                    node = node[_metadata_key(key)]
                shapes.append(tuple(node.shape))
            except (KeyError, IndexError, TypeError, AttributeError):
                rows = (old_workers,) if _is_per_worker(spec) else leaf.shape[:1]
                shapes.append((*rows, *leaf.shape[1:]))
        return jax.tree_util.tree_unflatten(treedef, shapes)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

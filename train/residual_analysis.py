"""Residual value distributions of chosen layers (the ResiReduce paper's Fig. 4).

With ``residual_analysis.layers`` set to a regex, the run records, at the configured steps,
a histogram of worker 0's residual values (in a hierarchical run: node 0's, from its
devices' shards) for every matching leaf and plots their
probability densities on one figure per snapshot. Adjacent layers of the same type whose
curves overlap are good candidates for a shared residual (§4.1).

Per-leaf residuals exist only where every layer keeps its own (variant ``ef``, or layers
left as singletons); run the analysis with ``compression.variant=ef`` to see all layers,
as the paper did before grouping. Outputs: ``<workdir>/residual_pdfs.npz`` (bin edges and
densities per snapshot and leaf) and ``<workdir>/residual_pdfs_step<k>.png``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import ml_collections
import numpy as np

import resireduce_jax as rr

__all__ = ["Recorder", "per_leaf_residuals"]


def per_leaf_residuals(
    opt_state: Any, plan: rr.exchange.ExchangePlan, worker: int = 0
) -> dict[str, np.ndarray]:
    """``{leaf path: residual of one worker}`` for every leaf with its own dense residual.

    In a hierarchical run (``local_devices``; the plan's stores are sharded) a leaf's
    residual is put back together from the shards of ``worker``'s node: the node's
    residual. Only the process that holds ``worker`` (and its node) returns values (others
    get an empty dict).
    """
    found: dict[str, Any] = {}
    for state in rr.exchange.exchange_states(opt_state):
        found.update(rr.exchange.leaf_residuals(state, plan))
    sharded = {p.group.paths[0]: p.shard for p in plan.kept if p.shard is not None}
    out = {}
    for name, value in found.items():
        shard = sharded.get(name)
        first = worker if shard is None else worker - worker % shard.count
        rows = range(first, first + (1 if shard is None else shard.count))
        pieces = {}
        for device_shard in value.addressable_shards:  # no cross-process traffic
            row = device_shard.index[0].start or 0
            if row in rows:
                pieces[row] = np.asarray(device_shard.data)[0]
        if len(pieces) < len(rows):
            continue
        if shard is None:
            out[name] = pieces[worker]
        else:
            whole = np.concatenate([pieces[r] for r in rows])[: shard.shape2d[0]]
            out[name] = whole.reshape(shard.leaf_shape)
    return out


@dataclasses.dataclass
class Recorder:
    """Collects residual histograms during a run and plots them."""

    pattern: re.Pattern | None
    every: int
    bins: int
    workdir: str
    enabled: bool
    snapshots: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = dataclasses.field(
        default_factory=dict
    )

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict, workdir: str, is_main: bool) -> Recorder:
        pattern = re.compile(c.layers) if c.layers else None
        return cls(pattern, c.every, c.bins, workdir, enabled=is_main and pattern is not None)

    def due(self, step: int, total: int) -> bool:
        if self.pattern is None:
            return False
        return step == total or (self.every > 0 and step % self.every == 0)

    def record(self, step: int, opt_state: Any, plan: rr.exchange.ExchangePlan) -> None:
        if not self.enabled:
            return
        residuals = per_leaf_residuals(opt_state, plan)
        chosen = {k: v for k, v in residuals.items() if self.pattern.search(k)}
        if not chosen:
            raise ValueError(
                f"residual_analysis.layers={self.pattern.pattern!r} matches no leaf with its own "
                f"residual; leaves with one: {sorted(residuals)[:12]}... (use variant 'ef')."
            )
        pooled = np.concatenate([v.ravel() for v in chosen.values()])
        spread = float(np.std(pooled)) or 1.0
        edges = np.linspace(-4 * spread, 4 * spread, self.bins + 1)
        self.snapshots[step] = {
            k: (edges, np.histogram(v.ravel(), bins=edges, density=True)[0])
            for k, v in chosen.items()
        }
        self._plot(step)

    def _plot(self, step: int) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, (edges, density) in sorted(self.snapshots[step].items()):
            centers = 0.5 * (edges[:-1] + edges[1:])
            ax.plot(centers, density, label=name, linewidth=1)
        ax.set_xlabel("residual value")
        ax.set_ylabel("probability density")
        ax.set_title(f"Residual distributions, step {step} (worker 0)")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(os.path.join(self.workdir, f"residual_pdfs_step{step}.png"), dpi=120)
        plt.close(fig)

    def finish(self) -> None:
        if not self.enabled or not self.snapshots:
            return
        arrays = {}
        for step, per_leaf in self.snapshots.items():
            for name, (edges, density) in per_leaf.items():
                arrays[f"step{step}/{name}/edges"] = edges
                arrays[f"step{step}/{name}/density"] = density
        np.savez(os.path.join(self.workdir, "residual_pdfs.npz"), **arrays)

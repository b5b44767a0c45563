"""Residual value distributions of chosen layers (the ResiReduce paper's Fig. 4).

With residual_analysis.layers set to a regex, the run records residual histograms.
It plots worker 0's residual densities per matching leaf, one figure per snapshot.
Run it with compression.variant=ef to see every layer, as the paper did.
sharing_report measures how well each group's members could share one residual.
Outputs: residual_pdfs.npz, residual_pdfs_step<k>.png and residual_sharing.json.
The outputs and the sharing measures: docs/design.md, "Residual analysis
(train/residual_analysis.py)".
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np

import resireduce_jax as rr

__all__ = ["Recorder", "format_sharing", "per_leaf_residuals", "sharing_report"]


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


def sharing_report(
    residuals: dict[str, np.ndarray], grouping: rr.grouping.Grouping, phi: float = 0.5
) -> dict[str, dict[str, Any]]:
    """How well one residual could stand for each group's members (ResiReduce paper §4).

    Args:
      residuals: ``{leaf path: one worker's residual}`` (e.g. :func:`per_leaf_residuals`
        of an error-feedback run).
      grouping: the grouping rules (:mod:`resireduce_jax.grouping`) applied to these leaves.
      phi: weight of the L1 term in ResiReduce-w's member weights. The weights are
        computed from the residuals themselves (``weight_source="residual"``, the default);
        a run with ``weight_source="compensated"`` weighs by the compensated gradients,
        which an EF run's residuals do not give, so its stores' weights differ.

    Returns:
      ``{group label: {"members", "cosine_mean", "cosine_min", "cosine_max",
      "mean_error"}}`` for every group of two or more leaves: the pairwise cosine
      similarities of the members' residuals, and the mean over members of
      ``||r_i - r_w|| / ||r_i||``, where ``r_w`` is ResiReduce-w's weighted mean of the
      members (1.0: the shared store keeps nothing of a member; 0: it loses nothing).
    """
    report = {}
    if isinstance(grouping, rr.grouping.RegexGrouping):
        # The chosen leaves are part of the tree the rules were written for.
        grouping = dataclasses.replace(grouping, unmatched="ignore")
    # A flat dict keyed by path is a pytree whose leaf paths are those keys.
    for group in rr.grouping.resolve(residuals, grouping, min_size=0):
        if len(group.paths) < 2:
            continue
        r = [np.asarray(residuals[p], np.float64).ravel() for p in group.paths]
        norms = [float(np.linalg.norm(x)) or 1.0 for x in r]
        cosines = [
            float(r[i] @ r[j]) / (norms[i] * norms[j])
            for i in range(len(r))
            for j in range(i + 1, len(r))
        ]
        # The stores' own weight function, on the residuals (weight_source="residual").
        weights = [float(rr.residual_stores.residual_weight(jnp.asarray(x), phi)) for x in r]
        shared = sum(w * x for w, x in zip(weights, r, strict=True)) / (sum(weights) or 1.0)
        errors = [float(np.linalg.norm(x - shared)) / m for x, m in zip(r, norms, strict=True)]
        report[group.label] = {
            "members": list(group.paths),
            "cosine_mean": float(np.mean(cosines)),
            "cosine_min": float(np.min(cosines)),
            "cosine_max": float(np.max(cosines)),
            "mean_error": float(np.mean(errors)),
        }
    return report


def format_sharing(report: dict[str, dict[str, Any]]) -> str:
    """The report as a table: one row a group."""
    lines = [f"  {'group':<34s} {'members':>7s} {'cosine mean [min, max]':>24s} {'lost':>6s}"]
    for label, row in report.items():
        cosine = f"{row['cosine_mean']:+.3f} [{row['cosine_min']:+.3f}, {row['cosine_max']:+.3f}]"
        lines.append(
            f"  {label:<34s} {len(row['members']):>7d} {cosine:>24s} {row['mean_error']:>6.2f}"
        )
    return "\n".join(lines)


@dataclasses.dataclass
class Recorder:
    """Collects residual histograms (and how well groups could share one residual) during a
    run and plots them."""

    pattern: re.Pattern | None
    every: int
    bins: int
    workdir: str
    enabled: bool
    grouping: rr.grouping.Grouping | None = None
    phi: float = 0.5
    snapshots: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = dataclasses.field(
        default_factory=dict
    )
    sharing: dict[int, dict[str, dict[str, Any]]] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_config(
        cls,
        c: ml_collections.ConfigDict,
        workdir: str,
        is_main: bool,
        grouping: rr.grouping.Grouping | None = None,
        phi: float = 0.5,
    ) -> Recorder:
        pattern = re.compile(c.layers) if c.layers else None
        enabled = is_main and pattern is not None
        return cls(pattern, c.every, c.bins, workdir, enabled, grouping=grouping, phi=phi)

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
        if self.grouping is not None:
            self.sharing[step] = sharing_report(chosen, self.grouping, self.phi)
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
        if self.sharing:
            with open(os.path.join(self.workdir, "residual_sharing.json"), "w") as f:
                json.dump({str(step): groups for step, groups in self.sharing.items()}, f, indent=1)
            last = max(self.sharing)
            if self.sharing[last]:
                print(
                    f"Residual sharing at step {last} (worker 0; 'lost': how far ResiReduce-w's "
                    "shared residual is from a member's, relative to it):\n"
                    + format_sharing(self.sharing[last]),
                    flush=True,
                )

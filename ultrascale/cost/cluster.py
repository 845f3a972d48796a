"""Cluster facts that are measured rather than written down: the ``cpu_local`` peak."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ultrascale.runtime.peak import gemm_rate

if TYPE_CHECKING:
    from ultrascale.config.cluster import ClusterConfig


def resolve_cluster(cluster: ClusterConfig) -> None:
    """Fill in measured values (``measure_peak``) so the rest of the planner reads plain numbers: the measured
    peak is written into ``cluster`` (plan.py's, before anything reads it)."""
    if cluster.measure_peak:
        cluster.peak_tflops = round(gemm_rate()["flops"] / 1e12, 4)
        cluster.measure_peak = False

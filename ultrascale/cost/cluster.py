"""Cluster facts that are measured rather than written down: the ``cpu_local`` peak."""

from __future__ import annotations

from omegaconf import DictConfig, open_dict

from ultrascale.runtime.peak import gemm_rate


def resolve_cluster(cfg: DictConfig) -> DictConfig:
    """Fill in measured values (``measure_peak``) so the rest of the planner reads plain numbers. ``cfg`` is the
    composed DictConfig (plan.py's, before anything reads it): the measured peak is written into it."""
    if cfg.cluster.measure_peak:
        with open_dict(cfg):
            cfg.cluster.peak_tflops = round(gemm_rate()["flops"] / 1e12, 4)
            cfg.cluster.measure_peak = False
    return cfg

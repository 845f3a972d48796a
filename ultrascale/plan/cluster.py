"""Cluster facts that are measured rather than written down: the ``cpu_local`` peak."""

from __future__ import annotations

import time

from omegaconf import DictConfig, open_dict


def measure_matmul_tflops(n: int = 1024, repeats: int = 5) -> float:
    """Best-of-``repeats`` fp32 matmul throughput on this machine's torch threads (TFLOP/s)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up: thread pool and allocation
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e12


def resolve_cluster(cfg: DictConfig) -> DictConfig:
    """Fill in measured values (``measure_peak``) so the rest of the planner reads plain numbers."""
    if cfg.cluster.measure_peak:
        with open_dict(cfg):
            cfg.cluster.peak_tflops = round(measure_matmul_tflops(), 4)
            cfg.cluster.measure_peak = False
    return cfg

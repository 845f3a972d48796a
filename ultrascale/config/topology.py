"""Rank layout: how world size splits into data, tensor, pipeline, sequence and expert parallel groups."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Topology:
    """Degrees of each parallel dimension. ``dp`` is derived: world / (tp * pp * sp).

    Sequence-parallel ranks see different tokens of the same samples, so they do not multiply the
    number of samples per step; ``dp`` alone does. Expert parallelism re-slices the dp ranks (ep | dp).
    """

    world: int
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.sp)

    def grad_accum(self, micro_batch: int, global_batch: int) -> int:
        return global_batch // (micro_batch * self.dp)

    def as_dict(self) -> dict:
        return {**asdict(self), "dp": self.dp}

    def describe(self) -> str:
        return f"world={self.world} dp={self.dp} tp={self.tp} pp={self.pp} sp={self.sp} ep={self.ep}"

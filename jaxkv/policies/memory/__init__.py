"""KV-native agent memory. MemArt (seed 003): AABB key boxes per block, the
eq. 3 bound, Table 1's normalisation x aggregation and chronological top-k
(`memart`)."""

from jaxkv.policies.memory import memart

__all__ = ["memart"]

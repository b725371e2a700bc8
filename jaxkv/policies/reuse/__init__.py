"""Cross-prompt reuse. Segment reuse (seed 002): discovery and the MinHash-LSH
index (`index`), the host segment store (`store`), and tiered admission
(`admission`); the runner that splices and recomputes is
`jaxkv.engine.reuse.ReuseRunner`. SemShareKV (seed 001): E-cache LSH matching,
similarity and the recompute / retention plan (`semshare`); its runner is
`jaxkv.engine.semshare.SemShareRunner`."""

from jaxkv.policies.reuse import semshare
from jaxkv.policies.reuse.admission import Decision, decide
from jaxkv.policies.reuse.index import Match, SegmentIndex, canonical_table, structural_spans
from jaxkv.policies.reuse.store import Fingerprint, Segment, SegmentStore, break_even

__all__ = ["Decision", "Fingerprint", "Match", "Segment", "SegmentIndex", "SegmentStore",
           "break_even", "canonical_table", "decide", "semshare", "structural_spans"]

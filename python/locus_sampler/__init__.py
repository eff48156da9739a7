"""A locality-aware drop-in for torch.utils.data.DistributedSampler.

Each rank reads the shards Locus places on its own node (``/v1/assign``), in a
deterministic two-level shuffle, every sample once per epoch with equal counts per
rank; ``state_dict``/``load_state_dict`` resume mid-epoch, also at another world size.
When Locus cannot be reached it warns and falls back to DistributedSampler's order.
``shard_files`` deals whole shard files (tar, MDS) to a rank's DataLoader workers.
"""

from .client import LocusUnavailable, assign
from .plan import consumed, epoch_plan, per_rank, rendezvous_owner
from .sampler import LocusSampler, shard_files

__all__ = [
    "LocusSampler",
    "LocusUnavailable",
    "assign",
    "consumed",
    "epoch_plan",
    "per_rank",
    "rendezvous_owner",
    "shard_files",
]

"""LocusSampler: the plan of ``plan.py`` behind DistributedSampler's interface."""

from __future__ import annotations

import os
import random
import socket
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence

from . import client, plan

try:  # The sampler works without torch (tests, other loaders); with it, it is a Sampler.
    import torch
    from torch.utils.data import Sampler as _Base
except ImportError:  # pragma: no cover - exercised where torch is absent
    torch = None
    _Base = object


def _world() -> tuple:
    """(world size, rank) from torch.distributed when it is running, else (1, 0)."""
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


# A node id is a DNS-label-like name; this bounds what one rank sends to the others.
_NODE_BYTES = 256


def _gather_nodes(node: str, world: int) -> List[str]:
    """Every rank's node id, in rank order. Sent as fixed-size byte tensors rather than
    with all_gather_object, which needs NumPy (not a dependency of torch) to decode."""
    if world == 1:
        return [node]
    raw = node.encode()
    if len(raw) > _NODE_BYTES:
        raise ValueError(f"node id {node!r} is longer than {_NODE_BYTES} bytes")
    mine = torch.zeros(_NODE_BYTES + 2, dtype=torch.uint8)
    mine[0], mine[1] = len(raw) >> 8, len(raw) & 0xFF
    if raw:
        mine[2 : 2 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    out = [torch.zeros_like(mine) for _ in range(world)]
    torch.distributed.all_gather(out, mine)
    names = []
    for t in out:
        b = t.tolist()
        n = (b[0] << 8) | b[1]
        names.append(bytes(b[2 : 2 + n]).decode())
    return names


class LocusSampler(_Base):  # type: ignore[misc]
    """Yields the dataset indices this rank should read.

    ``files`` are the dataset's file paths as the version names them (relative to the
    mount), ``files[i]`` being sample ``i``. ``dataset`` is ``NAME@VERSION``. The
    metadata service's HTTP address comes from ``url`` or ``LOCUS_HTTP``, the token from
    ``token`` or ``LOCUS_TOKEN``. Each rank's node is ``node`` (default: the host name,
    which is the node id Locus uses by default), gathered across ranks with
    torch.distributed unless ``rank_nodes`` lists them.
    """

    def __init__(
        self,
        files: Sequence[str],
        dataset: str,
        url: Optional[str] = None,
        token: Optional[str] = None,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        node: Optional[str] = None,
        rank_nodes: Optional[Sequence[str]] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        block_size: int = 256,
        timeout: float = 10.0,
        assignment: Optional[Dict[str, Any]] = None,
    ) -> None:
        world, me = _world()
        self.num_replicas = num_replicas if num_replicas is not None else world
        self.rank = rank if rank is not None else me
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is outside a world of {self.num_replicas}")
        self.n = len(files)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.block_size = block_size
        self.epoch = 0
        self._skip = 0
        self._exclude: set = set()
        self.local_fraction: Optional[float] = None
        if rank_nodes is None:
            here = node or os.environ.get("LOCUS_NODE") or socket.gethostname()
            if world > 1 and self.num_replicas == world:
                rank_nodes = _gather_nodes(here, world)
            elif self.num_replicas == 1:
                rank_nodes = [here]
            else:
                # Guessing would place every rank on this node and the plan would be
                # wrong for all the others.
                raise ValueError(
                    "rank_nodes is required when the ranks' nodes cannot be gathered "
                    "(torch.distributed not initialized, or num_replicas differs from it)"
                )
        if len(rank_nodes) != self.num_replicas:
            raise ValueError("rank_nodes must name one node per rank")
        self.partitions: Optional[List[List[int]]] = None
        self.owner: Optional[List[int]] = None
        # Sample sizes, when Locus lists them: balancing then moves the smallest.
        self.weight: Optional[List[int]] = None
        try:
            answer = assignment or client.assign(
                url or os.environ.get("LOCUS_HTTP", "http://127.0.0.1:7401"),
                dataset,
                list(rank_nodes),
                token,
                timeout,
            )
            self.partitions, self.owner = self._from_answer(files, answer)
            self.local_fraction = answer.get("local_fraction")
        except client.LocusUnavailable as e:
            warnings.warn(
                f"Locus could not be asked where {dataset} is ({e}); reading in "
                "DistributedSampler's order, without locality",
                RuntimeWarning,
                stacklevel=2,
            )

    def _from_answer(self, files: Sequence[str], answer: Dict[str, Any]) -> tuple:
        index = {f: i for i, f in enumerate(files)}
        if len(index) != len(files):
            raise ValueError("files: a path is listed twice")
        shard_of: Dict[int, int] = {}
        partitions: List[List[int]] = []
        weight = [0] * len(files)
        for s in sorted(answer["shards"], key=lambda s: s["id"]):
            shard_of[s["id"]] = len(partitions)
            partitions.append(sorted(index[f] for f in s["files"] if f in index))
            for f, size in zip(s["files"], s.get("sizes", [])):
                if f in index:
                    weight[index[f]] = size
        if any(s.get("sizes") for s in answer["shards"]):
            self.weight = weight
        owner = [0] * len(partitions)
        for r in answer["ranks"]:
            for sid in r["shards"]:
                if sid in shard_of:
                    owner[shard_of[sid]] = r["rank"]
        # Samples the version does not hold (a dataset object with extra entries): one
        # more partition, placed like any partition without Locus.
        known = {i for p in partitions for i in p}
        extra = [i for i in range(len(files)) if i not in known]
        if extra:
            partitions.append(extra)
            owner.append(plan.rendezvous_owner(len(partitions) - 1, self.num_replicas, self.seed))
        return partitions, owner

    # --- DistributedSampler's interface ---------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._skip = 0
        self._exclude = set()

    def _plan(self) -> List[List[int]]:
        if self.partitions is None:
            return self._distributed_order()
        return plan.epoch_plan(
            self.partitions,
            self.owner,
            self.num_replicas,
            self.seed,
            self.epoch,
            self.drop_last,
            self.shuffle,
            self.block_size,
            self._exclude,
            self.weight,
        )

    def _distributed_order(self) -> List[List[int]]:
        """DistributedSampler's own order (torch's generator when torch is present)."""
        remaining = [i for i in range(self.n) if i not in self._exclude]
        if self.shuffle:
            if torch is not None:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)
                perm = torch.randperm(len(remaining), generator=g).tolist()
                remaining = [remaining[i] for i in perm]
            else:
                random.Random(self.seed + self.epoch).shuffle(remaining)
        w = self.num_replicas
        total = plan.per_rank(len(remaining), w, self.drop_last) * w
        if self.drop_last:
            remaining = remaining[:total]
        elif remaining:
            while len(remaining) < total:
                remaining += remaining[: total - len(remaining)]
        return [remaining[r:total:w] for r in range(w)]

    def __iter__(self) -> Iterator[int]:
        mine = self._plan()[self.rank]
        return iter(mine[self._skip :])

    def __len__(self) -> int:
        return len(self._plan()[self.rank]) - self._skip

    # --- resumption -------------------------------------------------------------------

    def state_dict(self, consumed: int) -> Dict[str, Any]:
        """What to save after this rank has yielded ``consumed`` samples this epoch
        (every rank the same count: they run in step)."""
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "consumed": self._skip + consumed,
            "exclude": sorted(self._exclude),
            "owner": self.owner,
            "n": self.n,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continues the saved epoch. At the same world size this rank skips what it
        read; at another, what every old rank read is left out and the rest is planned
        over the ranks present, so each sample is still read once this epoch."""
        if state["n"] != self.n:
            raise ValueError(f"the saved sampler had {state['n']} samples, this one {self.n}")
        self.epoch, self.seed = state["epoch"], state["seed"]
        old_exclude = set(state.get("exclude", []))
        if state["num_replicas"] == self.num_replicas and state.get("owner") == self.owner:
            self._exclude = old_exclude
            self._skip = state["consumed"]
            return
        old = LocusSampler.__new__(LocusSampler)
        old.__dict__.update(self.__dict__)
        old.num_replicas = state["num_replicas"]
        old.owner = state.get("owner")
        if old.owner is None:
            old.partitions = None
        old._exclude, old._skip = old_exclude, 0
        read = plan.consumed(old._plan(), state["consumed"])
        # The rest is planned with this sampler's own owners: what Locus assigned the
        # ranks present (or rendezvous placement, which moves the fewest partitions).
        self._exclude = old_exclude | read
        self._skip = 0


def shard_files(sampler: "LocusSampler", worker: int = 0, num_workers: int = 1) -> List[int]:
    """For loaders that read shards as files (WebDataset or MosaicML-style tar or MDS
    shards): the shard files, as indices into the sampler's ``files``, that this rank's
    DataLoader worker ``worker`` of ``num_workers`` reads this epoch, in order.

    Built on the sampler's epoch plan, so across every rank and worker each file is read
    once per epoch, deterministically for (seed, epoch), and a resumed sampler's skip
    applies. Within a rank the files of its own shards (those Locus assigned to it, on its
    node wherever a replica allows) come first, then the files balancing moved to it;
    each kind is dealt to the workers in turn. Inside a worker, call it with
    ``torch.utils.data.get_worker_info()``'s ``id`` and ``num_workers``.
    """
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} is outside {num_workers} workers")
    mine = list(iter(sampler))
    if sampler.partitions is None or sampler.owner is None:
        own, moved = mine, []
    else:
        part_of = {i: p for p, members in enumerate(sampler.partitions) for i in members}
        own = [i for i in mine if sampler.owner[part_of[i]] == sampler.rank]
        moved = [i for i in mine if sampler.owner[part_of[i]] != sampler.rank]
    return own[worker::num_workers] + moved[worker::num_workers]

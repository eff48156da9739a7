"""The epoch plan: which sample indices each rank reads, in which order.

Pure functions of their arguments (no I/O, no torch), so every rank computes the same
plan from the same inputs and the properties are testable:

* Samples are grouped into *partitions* (a Locus shard's files). A partition has one
  *owner* rank: the rank Locus assigned it to (its node holds the shard), or, without
  Locus, a rendezvous-hash choice that moves as few partitions as possible when the
  world size changes.
* Two-level shuffle, deterministic for (seed, epoch): each rank's partitions in a
  shuffled order, then its samples shuffled within blocks of ``block`` consecutive
  samples, so reads stay within a few shards at a time (sequential on disk) yet mix.
* Equal counts: ranks above the per-rank count hand samples to ranks below it, in
  rank order — their smallest ones when sample sizes are known (``weight``), so the
  fewest bytes leave the node that holds them, else their last ones; without ``drop_last`` the count is rounded up and the shortfall
  (< world size samples) is padded by repeating samples, like DistributedSampler;
  with ``drop_last`` it is rounded down and the surplus (< world size) dropped.
* Resumption across a world-size change: ``exclude`` removes samples already consumed
  this epoch before the plan is made, so what was read and what is left are disjoint.
"""

from __future__ import annotations

import hashlib
import random
from typing import Iterable, List, Optional, Sequence, Set


def _rng(*key: object) -> random.Random:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def rendezvous_owner(partition: int, world: int, seed: int = 0) -> int:
    """The rank a partition belongs to without Locus: highest random weight hashing,
    so going from W to W+1 ranks moves only the partitions the new rank wins."""
    best, best_w = 0, -1
    for r in range(world):
        w = int.from_bytes(
            hashlib.blake2b(f"{seed}:{partition}:{r}".encode(), digest_size=8).digest(), "little"
        )
        if w > best_w:
            best, best_w = r, w
    return best


def per_rank(n: int, world: int, drop_last: bool) -> int:
    """Samples each rank reads in an epoch of ``n`` samples."""
    if drop_last:
        return n // world
    return -(-n // world)


def epoch_plan(
    partitions: Sequence[Sequence[int]],
    owner: Sequence[int],
    world: int,
    seed: int,
    epoch: int,
    drop_last: bool = False,
    shuffle: bool = True,
    block: int = 256,
    exclude: Optional[Set[int]] = None,
    weight: Optional[Sequence[int]] = None,
) -> List[List[int]]:
    """Each rank's sample indices for ``epoch``, all of equal length."""
    if world < 1:
        raise ValueError("world size must be at least 1")
    if len(owner) != len(partitions):
        raise ValueError("one owner per partition")
    if any(not 0 <= o < world for o in owner):
        raise ValueError("an owner outside the world")
    exclude = exclude or set()
    mine: List[List[int]] = [[] for _ in range(world)]
    for p, o in enumerate(owner):
        mine[o].append(p)
    ranks: List[List[int]] = []
    for r in range(world):
        parts = list(mine[r])
        if shuffle:
            _rng("parts", seed, epoch, r).shuffle(parts)
        samples = [i for p in parts for i in partitions[p] if i not in exclude]
        if shuffle and block > 1:
            rng = _rng("block", seed, epoch, r)
            for b in range(0, len(samples), block):
                chunk = samples[b : b + block]
                rng.shuffle(chunk)
                samples[b : b + block] = chunk
        ranks.append(samples)
    n = sum(len(s) for s in ranks)
    target = per_rank(n, world, drop_last)
    # Surplus from the ranks above the count, in rank order, each giving its last ones.
    pool: List[int] = []
    for s in ranks:
        excess = len(s) - target
        if excess <= 0:
            continue
        if weight is None:
            pool.extend(s[target:])
            del s[target:]
        else:
            chosen = set(sorted(range(len(s)), key=lambda j: (weight[s[j]], s[j]))[:excess])
            pool.extend(x for j, x in enumerate(s) if j in chosen)
            s[:] = [x for j, x in enumerate(s) if j not in chosen]
    taken = 0
    for s in ranks:
        need = target - len(s)
        if need > 0:
            s.extend(pool[taken : taken + need])
            taken += min(need, len(pool) - taken)
    # Without drop_last, fewer samples than ranks × count: repeat from the start.
    if not drop_last and n > 0:
        every = [i for s in ranks for i in s]
        k = 0
        for s in ranks:
            while len(s) < target:
                s.append(every[k % len(every)])
                k += 1
    return ranks


def consumed(plan: Iterable[Sequence[int]], count: int) -> Set[int]:
    """The samples read once every rank has read ``count`` of its plan."""
    out: Set[int] = set()
    for s in plan:
        out.update(s[:count])
    return out

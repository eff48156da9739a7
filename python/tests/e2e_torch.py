"""One rank of a real PyTorch job, run by tests/pytorch.rs against a real Locus cluster:
torch.distributed with gloo, a DataLoader with worker processes (persistent) whose sampler
is LocusSampler, reading the dataset's files through this rank's Locus mount.

    python3 e2e_torch.py OUT.json EPOCH [--stop-after BATCHES] [--resume STATE.json]
                                        [--shard-files]

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch.distributed), LOCUS_NODE
(this rank's node id), LOCUS_HTTP (the metadata service's HTTP address), MOUNT (this
rank's mount of the version), DATASET (NAME@VERSION).

Writes OUT.json: the samples this rank's loader delivered, in order, each with the
SHA-256 of the bytes read, and (with --stop-after, rank 0) the sampler's state after
that many batches, for a later run to resume from. With --shard-files the files are
read as a WebDataset-style loader reads its shard files: an IterableDataset whose
workers each take `shard_files(sampler, worker, num_workers)`.
"""

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info  # noqa: E402

from locus_sampler import LocusSampler, shard_files  # noqa: E402

BATCH = 4


class MountFiles(Dataset):
    """Sample i is the file files[i] under the mount, read whole."""

    def __init__(self, root, files):
        self.root, self.files = root, files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(os.path.join(self.root, self.files[i]), "rb") as f:
            data = f.read()
        return i, hashlib.sha256(data).hexdigest(), len(data)


class ShardFiles(IterableDataset):
    """Whole files dealt to this rank's workers by `shard_files`, as a tar-shard loader."""

    def __init__(self, root, files, sampler):
        self.root, self.files, self.sampler = root, files, sampler

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for i in shard_files(self.sampler, worker, workers):
            with open(os.path.join(self.root, self.files[i]), "rb") as f:
                data = f.read()
            yield i, hashlib.sha256(data).hexdigest(), len(data)


def collate(batch):
    return batch


def main():
    out, epoch = sys.argv[1], int(sys.argv[2])
    args = sys.argv[3:]
    stop_after = int(args[args.index("--stop-after") + 1]) if "--stop-after" in args else None
    resume = args[args.index("--resume") + 1] if "--resume" in args else None

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.environ["MOUNT"]
    # The samples: the version's regular files, listed through the mount.
    files = sorted(
        os.path.relpath(os.path.join(d, f), root)
        for d, _, fs in os.walk(root)
        for f in fs
        if not os.path.islink(os.path.join(d, f))
    )
    # The ranks' nodes are gathered with torch.distributed (LOCUS_NODE on each).
    sampler = LocusSampler(files, os.environ["DATASET"], seed=7)
    sampler.set_epoch(epoch)
    if resume:
        with open(resume) as f:
            sampler.load_state_dict(json.load(f))
    if "--shard-files" in args:
        loader = DataLoader(
            ShardFiles(root, files, sampler),
            batch_size=BATCH,
            num_workers=2,
            persistent_workers=True,
            collate_fn=collate,
        )
    else:
        loader = DataLoader(
            MountFiles(root, files),
            batch_size=BATCH,
            sampler=sampler,
            num_workers=2,
            persistent_workers=True,
            collate_fn=collate,
        )
    got = []
    batches = 0
    for batch in loader:
        got.extend(batch)
        batches += 1
        if stop_after is not None and batches == stop_after:
            break
    result = {
        "rank": rank,
        "world": world,
        "node": os.environ["LOCUS_NODE"],
        "samples": [{"index": i, "sha256": h, "bytes": n} for i, h, n in got],
        "files": files,
        "local_fraction": sampler.local_fraction,
    }
    if stop_after is not None:
        # Every rank consumed the same number of samples (they run in step).
        result["state"] = sampler.state_dict(len(got))
    with open(out, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

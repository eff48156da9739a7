"""Run by tests/sampler.rs against a real metadata service: the sampler for every rank
of a job, from /v1/assign, and DistributedSampler's order for the same job, each
scored by the share of samples a rank reads from a shard on its own node.

    python3 e2e_assign.py HTTP_URL DATASET SRC_DIR NODE,NODE,...   (token: LOCUS_TOKEN)
"""

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from locus_sampler import LocusSampler, assign  # noqa: E402

url, dataset, src, nodes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
# The samples: regular files (a symlink is no sample of its own).
files = sorted(
    os.path.relpath(os.path.join(d, f), src)
    for d, _, fs in os.walk(src)
    for f in fs
    if not os.path.islink(os.path.join(d, f))
)
world = len(nodes)
answer = assign(url, dataset, nodes)
index = {f: i for i, f in enumerate(files)}
node_of_shard = {}
for r in answer["ranks"]:
    for s in r["shards"]:
        node_of_shard[s] = r["node"]
node_of_sample = {index[f]: node_of_shard[s["id"]] for s in answer["shards"] for f in s["files"]}


size = [os.path.getsize(os.path.join(src, f)) for f in files]


def score(plans):
    total = sum(len(p) for p in plans)
    local = sum(1 for r, p in enumerate(plans) for i in p if node_of_sample[i] == nodes[r])
    nbytes = sum(size[i] for p in plans for i in p)
    local_bytes = sum(size[i] for r, p in enumerate(plans) for i in p if node_of_sample[i] == nodes[r])
    covered = set(i for p in plans for i in p) == set(range(len(files)))
    return {
        "local_share": local / total,
        "local_byte_share": local_bytes / max(nbytes, 1),
        "covered": covered,
        "equal": len({len(p) for p in plans}) == 1,
    }


locus = [list(LocusSampler(files, dataset, url=url, num_replicas=world, rank=r, rank_nodes=nodes, seed=1))
         for r in range(world)]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    plain = [list(LocusSampler(files, dataset, url="http://127.0.0.1:1", num_replicas=world, rank=r,
                               rank_nodes=nodes, seed=1, timeout=1)) for r in range(world)]
print(json.dumps({"locus": score(locus), "distributed": score(plain), "files": len(files)}))

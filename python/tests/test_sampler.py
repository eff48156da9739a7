"""Properties of the epoch plan and the sampler (hypothesis; no torch, no Locus)."""

import collections
import warnings

from hypothesis import given, settings
from hypothesis import strategies as st

from locus_sampler import LocusSampler, consumed, epoch_plan, per_rank, rendezvous_owner, shard_files


@st.composite
def layouts(draw):
    """Partitions of consecutive sample indices, a world, and an owner per partition."""
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=24))
    world = draw(st.integers(1, 8))
    owner = draw(st.lists(st.integers(0, world - 1), min_size=len(sizes), max_size=len(sizes)))
    parts, start = [], 0
    for s in sizes:
        parts.append(list(range(start, start + s)))
        start += s
    return parts, owner, world, start


def counts(plan):
    return collections.Counter(i for r in plan for i in r)


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(0, 2**32), st.integers(0, 50), st.booleans(), st.integers(1, 64))
def test_every_sample_once_and_equal_counts(layout, seed, epoch, drop_last, block):
    parts, owner, world, n = layout
    plan = epoch_plan(parts, owner, world, seed, epoch, drop_last, True, block)
    assert len({len(r) for r in plan}) == 1, "equal counts per rank"
    assert len(plan[0]) == per_rank(n, world, drop_last)
    c = counts(plan)
    if drop_last:
        assert all(v == 1 for v in c.values()), "no sample twice"
        assert n - len(c) < world, "fewer than one per rank dropped"
    else:
        assert set(c) == set(range(n)), "every sample read"
        assert sum(c.values()) - n < world, "fewer than one per rank padded"


@settings(max_examples=100, deadline=None)
@given(layouts(), st.integers(0, 2**32), st.integers(0, 50))
def test_deterministic_for_seed_and_epoch(layout, seed, epoch):
    parts, owner, world, _ = layout
    a = epoch_plan(parts, owner, world, seed, epoch)
    b = epoch_plan([list(p) for p in parts], list(owner), world, seed, epoch)
    assert a == b


def test_epochs_differ():
    parts = [list(range(i * 100, (i + 1) * 100)) for i in range(8)]
    owner = [i % 2 for i in range(8)]
    assert epoch_plan(parts, owner, 2, 7, 0) != epoch_plan(parts, owner, 2, 7, 1)
    # Unshuffled: partitions in order, samples in order.
    flat = epoch_plan(parts, owner, 2, 7, 0, shuffle=False)
    assert flat[0][:3] == [0, 1, 2]


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(0, 2**32), st.booleans())
def test_ranks_read_their_own_partitions_but_for_the_balancing_moves(layout, seed, weighted):
    parts, owner, world, n = layout
    weight = [(i * 7919) % 101 for i in range(n)] if weighted else None
    plan = epoch_plan(parts, owner, world, seed, 0, weight=weight)
    target = per_rank(n, world, False)
    owned = [sum(len(p) for p, o in zip(parts, owner) if o == r) for r in range(world)]
    of = {i: o for p, o in zip(parts, owner) for i in p}
    foreign = sum(1 for r, s in enumerate(plan) for i in s if of[i] != r)
    # Only what a rank must take to reach the count is someone else's (a padding
    # repeat may happen to be its own).
    need = sum(max(0, target - k) for k in owned)
    pads = world * target - n
    assert need - pads <= foreign <= need
    if weighted and pads == 0:
        # What a rank gave away is never heavier than what it kept.
        for r in range(world):
            kept = [weight[i] for i in plan[r] if of[i] == r]
            gone = [weight[i] for q in range(world) if q != r for i in plan[q] if of[i] == r]
            if kept and gone:
                assert max(gone) <= min(kept)


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(0, 2**32), st.data())
def test_resuming_at_another_world_size_reads_each_sample_once(layout, seed, data):
    parts, owner, world, n = layout
    plan = epoch_plan(parts, owner, world, seed, 3)
    k = data.draw(st.integers(0, len(plan[0])))
    read = consumed(plan, k)
    new_world = data.draw(st.integers(1, 8))
    new_owner = [rendezvous_owner(p, new_world, seed) for p in range(len(parts))]
    rest = epoch_plan(parts, new_owner, new_world, seed, 3, exclude=read)
    c = counts(rest)
    assert not (set(c) & read), "nothing read twice across the resume"
    assert set(c) | read == set(range(n)), "nothing missed"
    assert len({len(r) for r in rest}) == 1


def test_rendezvous_moves_few_partitions():
    before = [rendezvous_owner(p, 8) for p in range(1000)]
    after = [rendezvous_owner(p, 9) for p in range(1000)]
    moved = sum(a != b for a, b in zip(before, after))
    assert all(b == 8 for a, b in zip(before, after) if a != b), "only to the new rank"
    assert moved < 1000 * 2 / 9


def answer(files, world):
    """An assign answer: 6 shards of consecutive files, shard s on rank s % world."""
    shards = [files[i::6] for i in range(6)]
    return {
        "dataset": "ds@1",
        "local_fraction": 1.0,
        "shards": [{"id": i, "files": f} for i, f in enumerate(shards)],
        "ranks": [{"rank": r, "node": f"n{r}", "shards": [s for s in range(6) if s % world == r]} for r in range(world)],
    }


def sampler(files, world, rank, **kw):
    return LocusSampler(
        files, "ds@1", num_replicas=world, rank=rank, rank_nodes=[f"n{r}" for r in range(world)],
        assignment=answer(files, world), **kw,
    )


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 300), st.integers(1, 6), st.data())
def test_sampler_resumes_mid_epoch_where_it_stopped(n, world, data):
    files = [f"train/{i:05}.jpg" for i in range(n)]
    ranks = [sampler(files, world, r, seed=5) for r in range(world)]
    for s in ranks:
        s.set_epoch(2)
    full = [list(s) for s in ranks]
    k = data.draw(st.integers(0, len(full[0])))
    states = [s.state_dict(k) for s in ranks]
    # Same world: each rank continues exactly.
    for r in range(world):
        again = sampler(files, world, r, seed=5)
        again.load_state_dict(states[r])
        assert list(again) == full[r][k:]
        assert len(again) == len(full[r]) - k
    # Another world: the rest covers what was not read, once.
    new_world = data.draw(st.integers(1, 6))
    rest = []
    for r in range(new_world):
        s = sampler(files, new_world, r, seed=5)
        s.load_state_dict(states[0])
        rest.append(list(s))
    read = consumed(full, k)
    c = counts(rest)
    # Only a padding repeat (fewer than one per old rank) may be read on both sides.
    pads = world * len(full[0]) - n
    assert len(set(c) & read) <= pads
    assert set(c) | read == set(range(n))


def test_unreachable_locus_falls_back_to_distributed_order_with_a_warning():
    files = [f"f{i}" for i in range(10)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = LocusSampler(files, "ds@1", url="http://127.0.0.1:1", num_replicas=3, rank=1,
                         rank_nodes=["a", "b", "c"], timeout=1)
    assert any("DistributedSampler" in str(x.message) for x in w)
    plans = []
    for r in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = LocusSampler(files, "ds@1", url="http://127.0.0.1:1", num_replicas=3, rank=r,
                             rank_nodes=["a", "b", "c"], timeout=1)
        plans.append(list(t))
    assert list(s) == plans[1]
    assert {len(p) for p in plans} == {4}
    assert set(i for p in plans for i in p) == set(range(10))


def test_a_world_without_the_ranks_nodes_is_refused_not_guessed():
    import pytest

    with pytest.raises(ValueError, match="rank_nodes is required"):
        LocusSampler(["a"], "ds@1", num_replicas=2, rank=0, assignment=answer(["a"], 2))



def test_assign_asks_the_next_group_member_when_one_is_down_or_unavailable():
    import http.server
    import socket
    import threading

    import pytest

    from locus_sampler.client import LocusUnavailable, assign

    class Handler(http.server.BaseHTTPRequestHandler):
        status = 200

        def do_POST(self):  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers["content-length"]))
            body = b'{"ranks": [], "shards": []}' if self.status == 200 else b'{"error": "no leader"}'
            self.send_response(self.status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Busy(Handler):
        status = 503

    servers = [http.server.HTTPServer(("127.0.0.1", 0), h) for h in (Handler, Busy)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    live, busy = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    try:
        assert assign(f"{dead},{busy},{live}", "ds", ["n1"], token="") == {"ranks": [], "shards": []}
        with pytest.raises(LocusUnavailable) as e:
            assign(f"{dead},{busy}", "ds", ["n1"], token="")
        assert dead in str(e.value) and "503" in str(e.value)
    finally:
        for s in servers:
            s.shutdown()


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200), st.integers(1, 6), st.integers(1, 4), st.integers(0, 20))
def test_shard_files_reads_each_file_once_per_epoch_own_shards_first(n, world, workers, epoch):
    files = [f"shards/train-{i:05}.tar" for i in range(n)]
    ranks = [sampler(files, world, r, seed=3, drop_last=True) for r in range(world)]
    got = []
    for s in ranks:
        s.set_epoch(epoch)
        per_worker = [shard_files(s, w, workers) for w in range(workers)]
        # Deterministic for (seed, epoch).
        assert per_worker == [shard_files(s, w, workers) for w in range(workers)]
        # The rank's workers together read what the rank's sampler yields, no more.
        assert sorted(i for p in per_worker for i in p) == sorted(s)
        part_of = {i: p for p, m in enumerate(s.partitions) for i in m}
        for p in per_worker:
            own = [s.owner[part_of[i]] == s.rank for i in p]
            assert own == sorted(own, reverse=True), "own shards' files first"
        got.extend(i for p in per_worker for i in p)
    c = collections.Counter(got)
    assert all(v == 1 for v in c.values()), "no file twice in an epoch"
    assert n - len(c) < world, "fewer than one file per rank dropped (drop_last)"


def test_shard_files_order_changes_with_the_epoch_and_refuses_a_bad_worker():
    files = [f"shards/train-{i:05}.tar" for i in range(64)]
    s = sampler(files, 2, 0, seed=3)
    s.set_epoch(0)
    first = shard_files(s, 0, 2)
    s.set_epoch(1)
    assert shard_files(s, 0, 2) != first
    try:
        shard_files(s, 2, 2)
    except ValueError:
        pass
    else:
        raise AssertionError("worker 2 of 2 must be refused")

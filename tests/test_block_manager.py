"""Block manager: unit tests and a hypothesis state machine over its invariants."""

from __future__ import annotations

from typing import Dict, List, Optional

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_backend.core.block_allocator import BlockAllocator, NoFreeBlocksError
from paged_backend.core.prefix_cache import PrefixCache, hash_block
from paged_backend.core.block_manager import AllocStatus, BlockManager
from paged_backend.core.scheduler import common_prefix_len
from paged_backend.sampling_params import SamplingParams
from paged_backend.core.sequence import SequenceGroup, SequenceStatus

_ids = iter(range(10**9))


def make_group(tokens: List[int], n: int = 1) -> SequenceGroup:
    return SequenceGroup(f"r{next(_ids)}", None, tokens, SamplingParams(n=n, temperature=1.0))


def admit(bm: BlockManager, group: SequenceGroup) -> None:
    bm.allocate(group)
    group.set_status(SequenceStatus.RUNNING)


def compute(bm: BlockManager, seq) -> None:
    seq.num_computed_tokens = len(seq)
    bm.mark_computed(seq)


# ---- allocator and prefix cache --------------------------------------------------------------
def test_allocator_free_list_and_ref_counts():
    alloc = BlockAllocator(3)
    blocks = [alloc.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and alloc.get_num_free_blocks() == 0
    with pytest.raises(NoFreeBlocksError):
        alloc.allocate()
    alloc.incr(blocks[0])
    alloc.free(blocks[0])
    assert alloc.get_num_free_blocks() == 0
    alloc.free(blocks[0])
    assert alloc.get_num_free_blocks() == 1
    with pytest.raises(ValueError, match="double free"):
        alloc.free(blocks[0])
    with pytest.raises(ValueError, match="free"):
        alloc.incr(blocks[0])


def test_prefix_cache_parks_and_evicts_lru():
    cache = PrefixCache()
    alloc = BlockAllocator(2, prefix_cache=cache)
    a, b = alloc.allocate(), alloc.allocate()
    cache.insert(b"a", a)
    cache.insert(b"b", b)
    alloc.free(a)
    alloc.free(b)
    assert alloc.get_num_free_blocks() == 2 and cache.num_evictable == 2
    assert cache.lookup(b"b") == b
    alloc.incr(b)             # revived: no longer evictable
    assert cache.num_evictable == 1
    assert alloc.allocate() == a  # free list empty: evicts the least recently parked block
    assert cache.lookup(b"a") is None and cache.lookup(b"b") == b


def test_blocks_of_preempted_requests_are_evicted_last():
    cache = PrefixCache()
    alloc = BlockAllocator(3, prefix_cache=cache)
    blocks = [alloc.allocate() for _ in range(3)]
    for i, block in enumerate(blocks):
        cache.insert(bytes([i]), block)
    alloc.free(blocks[0], keep_for=7)   # parked for sequence 7, preempted by recomputation: it will be back
    alloc.free(blocks[1])
    alloc.free(blocks[2])
    assert [alloc.allocate() for _ in range(3)] == [blocks[1], blocks[2], blocks[0]]


def _computed_request(bm: BlockManager, tokens: List[int]) -> SequenceGroup:
    group = make_group(tokens)
    admit(bm, group)
    compute(bm, group.seqs[0])
    return group


def _first_evicted(bm: BlockManager, count: int) -> List[int]:
    """Take free blocks until `count` cached blocks have been evicted; the evicted blocks, in order."""
    cache, evicted, held = bm.prefix_cache, [], []
    while len(evicted) < count:
        before = dict(cache.block_to_hash)
        held.append(bm.device.allocate())
        evicted += [b for b in before if b not in cache.block_to_hash]
    for block in held:
        bm.device.free(block)
    return evicted


def test_blocks_parked_for_a_preempted_request_lose_priority_when_it_is_aborted():
    """Preempted by recomputation, a request's blocks are evicted after all others while it waits; once it is
    aborted they return to the ordinary LRU order (parked before the system prompt's: evicted before them)."""
    bm = BlockManager(block_size=4, num_blocks=8, enable_prefix_caching=True)
    preempted = _computed_request(bm, list(range(9)))   # 2 full blocks
    own = bm.block_tables[preempted.seqs[0].seq_id][:2]
    bm.free(preempted.seqs[0], will_recompute=True)
    preempted.set_status(SequenceStatus.WAITING)
    system = _computed_request(bm, list(range(100, 109)))
    system_blocks = bm.block_tables[system.seqs[0].seq_id][:2]
    bm.free_group(system)      # finished: its prompt stays cached for later requests
    assert _first_evicted(bm, 1)[0] in system_blocks  # while the preempted request waits, its blocks are kept
    bm.free_group(preempted)   # aborted while waiting (Scheduler.abort frees the group the same way)
    assert sorted(_first_evicted(bm, 2)) == sorted(own)


def test_blocks_parked_for_a_preempted_request_lose_priority_when_it_is_readmitted():
    """A recomputed request with two samples: the leader is readmitted and reuses the common prefix, the other
    sample will fork from it and recompute its own tail. The blocks of that tail, parked for it, must not keep
    their evict-last priority once the request is back: a block parked later by another request outlives them."""
    bm = BlockManager(block_size=4, num_blocks=16, enable_prefix_caching=True)
    group = _computed_request(bm, list(range(8)))
    leader = group.seqs[0]
    sibling = leader.fork()
    bm.fork(leader, sibling)
    group.seqs.append(sibling)
    for seq, first in ((leader, 20), (sibling, 40)):  # one full block each of its own tokens, and one more
        for token in range(first, first + 5):
            seq.append_token(token, 0.0)
            bm.append_slots(seq)
            compute(bm, seq)
    sibling_tail = bm.block_tables[sibling.seq_id][2]
    for seq in group.seqs:
        bm.free(seq, will_recompute=True)
        seq.num_computed_tokens = 0
    group.fork_pending_len = common_prefix_len(group.seqs)
    group.set_status(SequenceStatus.WAITING)
    assert bm.can_allocate(group) == AllocStatus.OK
    admit(bm, group)
    assert leader.num_computed_tokens == 12  # the leader found its own blocks
    later = _computed_request(bm, list(range(100, 105)))
    later_block = bm.block_tables[later.seqs[0].seq_id][0]
    bm.free_group(later)
    assert _first_evicted(bm, 2) == [sibling_tail, later_block]  # parked first, evicted first


def test_hash_chains_through_prefix():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(None, [1, 2]) == h1


# ---- block manager ------------------------------------------------------------------------------
def test_allocates_only_needed_blocks_and_appends_on_demand():
    bm = BlockManager(block_size=4, num_blocks=10)
    group = make_group(list(range(5)))
    assert bm.can_allocate(group) == AllocStatus.OK
    admit(bm, group)
    seq = group.seqs[0]
    assert len(bm.block_tables[seq.seq_id]) == 2
    compute(bm, seq)
    for token in range(3):  # fills the second block
        seq.append_token(token, 0.0)
        assert bm.append_slots(seq) == []
        compute(bm, seq)
    assert len(bm.block_tables[seq.seq_id]) == 2
    seq.append_token(7, 0.0)
    bm.append_slots(seq)
    assert len(bm.block_tables[seq.seq_id]) == 3
    bm.free(seq)
    assert bm.get_num_free_blocks() == 10


def test_can_allocate_never_later_and_watermark():
    bm = BlockManager(block_size=4, num_blocks=10, watermark=0.1)  # one block kept free
    assert bm.can_allocate(make_group(list(range(40)))) == AllocStatus.NEVER
    big = make_group(list(range(32)))
    assert bm.can_allocate(big) == AllocStatus.OK
    admit(bm, big)
    assert bm.can_allocate(make_group(list(range(8)))) == AllocStatus.LATER
    assert bm.can_allocate(make_group(list(range(4)))) == AllocStatus.OK


def test_fork_shares_blocks_and_copy_on_write_fires_once_per_sharer():
    bm = BlockManager(block_size=4, num_blocks=10)
    group = make_group([1, 2, 3, 4, 5, 6])
    admit(bm, group)
    parent = group.seqs[0]
    compute(bm, parent)
    children = [parent.fork() for _ in range(2)]
    for child in children:
        bm.fork(parent, child)
    table = list(bm.block_tables[parent.seq_id])
    assert all(bm.device.ref_counts[b] == 3 for b in table)
    copies = []
    for seq in [parent] + children:
        seq.append_token(9, 0.0)
        copies.append(bm.append_slots(seq))
    # the shared partly filled block is copied for the first two writers; the last one owns it
    assert [len(c) for c in copies] == [1, 1, 0]
    assert all(src == table[1] for c in copies for src, _ in c)
    assert bm.device.ref_counts[table[0]] == 3 and bm.device.ref_counts[table[1]] == 1
    for seq in [parent] + children:
        bm.free(seq)
    assert bm.get_num_free_blocks() == 10


def test_swap_out_and_in_move_shared_blocks_once():
    bm = BlockManager(block_size=4, num_blocks=8, num_swap_blocks=8)
    group = make_group([1, 2, 3, 4, 5])
    admit(bm, group)
    parent = group.seqs[0]
    compute(bm, parent)
    child = parent.fork()
    bm.fork(parent, child)
    group.seqs.append(child)
    out = {}
    assert bm.can_swap_out(group, out)
    bm.swap_out(group, out)
    assert len(out) == 2 and bm.get_num_free_blocks() == 8 and bm.get_num_free_swap_blocks() == 6
    group.set_status(SequenceStatus.SWAPPED)
    back = {}
    assert bm.can_swap_in(group, back) == AllocStatus.OK
    bm.swap_in(group, back)
    assert sorted(back) == sorted(out.values())
    assert bm.block_tables[parent.seq_id] == bm.block_tables[child.seq_id]
    assert bm.get_num_free_swap_blocks() == 8
    bm.free_group(group)
    assert bm.get_num_free_blocks() == 8


def test_prefix_caching_reuses_full_blocks_only():
    bm = BlockManager(block_size=4, num_blocks=20, enable_prefix_caching=True)
    first = make_group(list(range(10)))
    admit(bm, first)
    compute(bm, first.seqs[0])
    second = make_group(list(range(8)) + [50, 51, 52])
    admit(bm, second)
    s1, s2 = first.seqs[0], second.seqs[0]
    assert s2.num_computed_tokens == 8
    assert bm.block_tables[s2.seq_id][:2] == bm.block_tables[s1.seq_id][:2]
    assert bm.block_tables[s2.seq_id][2] != bm.block_tables[s1.seq_id][2]
    # a prompt made only of cached blocks still computes its last block (logits are needed)
    third = make_group(list(range(8)))
    admit(bm, third)
    assert third.seqs[0].num_computed_tokens == 4
    assert bm.num_cached_prefill_tokens == 12
    for g in (first, second, third):
        bm.free_group(g)
    assert bm.get_num_free_blocks() == 20


def test_token_slot_usage_counts_shared_blocks_once():
    bm = BlockManager(block_size=4, num_blocks=10)
    group = make_group([1, 2, 3, 4, 5])
    admit(bm, group)
    parent = group.seqs[0]
    child = parent.fork()
    bm.fork(parent, child)
    assert bm.token_slot_usage([parent, child]) == (5, 8)


# ---- state machine --------------------------------------------------------------------------------
BLOCK = 4


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / swap sequences; a model of every block's contents
    checks that no sequence ever reads a slot holding another token."""

    prefix_caching = False

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(BLOCK, num_blocks=24, num_swap_blocks=16, watermark=0.0,
                               enable_prefix_caching=self.prefix_caching)
        self.device: Dict[int, List[Optional[int]]] = {}
        self.host: Dict[int, List[Optional[int]]] = {}
        self.running: List[SequenceGroup] = []
        self.swapped: List[SequenceGroup] = []
        self.hash_tokens: Dict[bytes, List[int]] = {}

    # -- helpers --
    def _write(self, seq, upto: Optional[int] = None) -> None:
        """The step writes K/V (here: the token ids) of positions [computed, upto) into their slots."""
        upto = len(seq) if upto is None else upto
        table = self.bm.block_tables[seq.seq_id]
        for pos in range(seq.num_computed_tokens, upto):
            block = table[pos // BLOCK]
            self.device.setdefault(block, [None] * BLOCK)[pos % BLOCK] = seq.token_ids[pos]
        seq.num_computed_tokens = upto
        self.bm.mark_computed(seq)
        for i, h in enumerate(seq.block_hashes):
            self.hash_tokens[h] = seq.token_ids[i * BLOCK:(i + 1) * BLOCK]

    def _seqs(self):
        return [(g, s) for g in self.running for s in g.seqs]

    # -- rules --
    @precondition(lambda self: len(self.running) + len(self.swapped) < 6)
    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=14))
    def add(self, tokens):
        group = make_group(tokens)
        status = self.bm.can_allocate(group)
        if status != AllocStatus.OK:
            return
        admit(self.bm, group)
        seq = group.seqs[0]
        table = self.bm.block_tables[seq.seq_id]
        for pos in range(seq.num_computed_tokens):  # reused prefix blocks hold exactly these tokens
            assert self.device[table[pos // BLOCK]][pos % BLOCK] == tokens[pos]
        self._write(seq)
        self.running.append(group)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        group, seq = data.draw(st.sampled_from(self._seqs()))
        seq.append_token(token, 0.0)
        if self.bm.num_blocks_to_append([seq]) > self.bm.get_num_free_blocks():
            seq.token_ids.pop()
            return
        table = list(self.bm.block_tables[seq.seq_id])
        index = seq.num_computed_tokens // BLOCK
        expect_cow = index < len(table) and self.bm.device.ref_counts[table[index]] > 1
        predicted, free = self.bm.num_blocks_to_append([seq]), self.bm.get_num_free_blocks()
        copies = self.bm.append_slots(seq)
        assert free - self.bm.get_num_free_blocks() == predicted
        assert len(copies) == int(expect_cow)
        for src, dst in copies:
            assert src == table[index]
            self.device[dst] = list(self.device[src])
        self._write(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        group, seq = data.draw(st.sampled_from(self._seqs()))
        child = seq.fork()
        self.bm.fork(seq, child)
        group.seqs.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free_seq(self, data):
        group, seq = data.draw(st.sampled_from(self._seqs()))
        self.bm.free(seq)
        group.seqs.remove(seq)
        if not group.seqs:
            self.running.remove(group)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def recompute(self, data):
        """Preempt by recomputation as the scheduler does: free everything; re-admit the leader, which
        recomputes the common prefix; fork the others from it; each then computes its own tail."""
        group = data.draw(st.sampled_from(self.running))
        self.running.remove(group)
        for seq in group.seqs:
            self.bm.free(seq, will_recompute=True)
            seq.num_computed_tokens = 0
        if len(group.seqs) > 1:
            group.fork_pending_len = common_prefix_len(group.seqs)
        group.set_status(SequenceStatus.WAITING)
        if self.bm.can_allocate(group) != AllocStatus.OK:
            group.fork_pending_len = None
            return
        admit(self.bm, group)
        leader, *others = group.seqs
        shared = group.fork_pending_len
        if shared is not None:
            self._write(leader, upto=max(shared, leader.num_computed_tokens))
            for seq in others:
                self.bm.fork(leader, seq, shared)
                seq.num_computed_tokens = shared
                seq.status = SequenceStatus.RUNNING
            group.fork_pending_len = None
        if self.bm.num_blocks_to_append(group.seqs) > self.bm.get_num_free_blocks():
            self.bm.free_group(group)  # does not fit: dropped, as a request that fails
            return
        self._append_exactly(group.seqs)
        self.running.append(group)

    def _append(self, seq) -> None:
        """Slots (copying shared blocks first) and K/V for every uncomputed token of `seq`."""
        for src, dst in self.bm.append_slots(seq):
            self.device[dst] = list(self.device[src])
        self._write(seq)

    def _swap_out(self, groups: List[SequenceGroup]) -> None:
        mapping: Dict[int, int] = {}
        moved = []
        for group in groups:
            if not self.bm.can_swap_out(group, mapping):
                continue
            for seq in group.seqs:  # its sampled next token waits to be computed after swap-in
                seq.append_token(len(seq) % 4, 0.0)
            self.bm.swap_out(group, mapping)
            group.set_status(SequenceStatus.SWAPPED)
            self.running.remove(group)
            self.swapped.append(group)
            moved.append(group)
        assert len(set(mapping.values())) == len(mapping)  # one host block per device block
        for device_block, host_block in mapping.items():
            self.host[host_block] = list(self.device[device_block])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        self._swap_out([data.draw(st.sampled_from(self.running))])

    @precondition(lambda self: len(self.running) > 1)
    @rule(data=st.data())
    def swap_out_together(self, data):
        """Several requests swapped out in one step (they may share prefix-cached blocks)."""
        self._swap_out(data.draw(st.lists(st.sampled_from(self.running), min_size=2, max_size=4, unique=True)))

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        groups = data.draw(st.lists(st.sampled_from(self.swapped), min_size=1, max_size=3, unique=True))
        mapping: Dict[int, int] = {}
        for group in groups:
            if self.bm.can_swap_in(group, mapping) != AllocStatus.OK:
                continue
            before = set(mapping)
            self.bm.swap_in(group, mapping)
            for host_block in mapping.keys() - before:  # the runner copies them before any write of the step
                self.device[mapping[host_block]] = list(self.host[host_block])
            group.set_status(SequenceStatus.RUNNING)
            self.swapped.remove(group)
            self.running.append(group)
            self._append_exactly(group.seqs)

    def _append_exactly(self, seqs) -> None:
        """append_slots takes exactly the blocks num_blocks_to_append predicted, and they were free."""
        predicted, free = self.bm.num_blocks_to_append(seqs), self.bm.get_num_free_blocks()
        assert predicted <= free
        for seq in seqs:
            self._append(seq)
        assert free - self.bm.get_num_free_blocks() == predicted

    # -- invariants --
    @staticmethod
    def _check_pool(pool, tables) -> None:
        holders = [0] * pool.num_blocks
        for table in tables:
            for block in table:
                holders[block] += 1
        assert holders == pool.ref_counts
        cache = pool.prefix_cache
        free = list(pool.free_list) + (cache.parked_blocks() if cache else [])
        assert len(free) == len(set(free)) == pool.get_num_free_blocks()
        assert set(free) == {b for b, c in enumerate(pool.ref_counts) if c == 0}
        assert pool.get_num_free_blocks() + sum(1 for c in pool.ref_counts if c) == pool.num_blocks

    @invariant()
    def pools_consistent(self):
        self._check_pool(self.bm.device, self.bm.block_tables.values())
        self._check_pool(self.bm.host, self.bm.swapped_tables.values())

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for group, seq in self._seqs():
            table = self.bm.block_tables[seq.seq_id]
            for pos in range(seq.num_computed_tokens):
                assert self.device[table[pos // BLOCK]][pos % BLOCK] == seq.token_ids[pos]
        for group in self.swapped:
            for seq in group.seqs:
                table = self.bm.swapped_tables[seq.seq_id]
                for pos in range(seq.num_computed_tokens):
                    assert self.host[table[pos // BLOCK]][pos % BLOCK] == seq.token_ids[pos]

    @invariant()
    def cheap_usage_equals_the_walk(self):
        seqs = [s for _, s in self._seqs()]
        assert self.bm.kv_usage(seqs) == self.bm.token_slot_usage(seqs)

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        cache = self.bm.prefix_cache
        if cache is None:
            return
        for block_hash, block in cache.hash_to_block.items():
            assert self.device[block] == self.hash_tokens[block_hash]

    def teardown(self):
        for group in self.running + self.swapped:
            self.bm.free_group(group)
        assert self.bm.get_num_free_blocks() == self.bm.num_blocks
        assert self.bm.get_num_free_swap_blocks() == self.bm.num_swap_blocks


class PrefixCachingMachine(BlockManagerMachine):
    prefix_caching = True


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
TestPrefixCachingMachine = PrefixCachingMachine.TestCase
TestPrefixCachingMachine.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)

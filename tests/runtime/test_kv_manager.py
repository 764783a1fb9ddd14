from lineside.runtime.kv_manager import KVCacheArena, salted


def test_block_accounting_and_admission():
    a = KVCacheArena(num_slots=4, max_seq_len=64, block_size=16, num_blocks=6)
    assert a.total_blocks == 6 and a.blocks_per_slot == 4
    assert a.can_admit(40)  # 3 blocks
    s0, _ = a.allocate("r0", [1] * 10, 40, 9)
    assert a.reserved_blocks == 3
    s1, _ = a.allocate("r1", [2] * 10, 48, 9)
    assert (s0, s1) == (0, 1) and a.reserved_blocks == 6
    assert not a.can_admit(1)  # slots left, blocks not
    a.append(s0, [1] * 17)
    assert a.used_blocks == 2
    a.free(s1)
    assert a.can_admit(48) and not a.can_admit(49)
    assert not KVCacheArena(num_slots=2, max_seq_len=64, block_size=16, num_blocks=3).fits_ever(64)


def test_can_admit_once_slots_are_freed():
    a = KVCacheArena(num_slots=2, max_seq_len=64, block_size=16, num_blocks=5)
    a.allocate("x", [1], 40, 0)  # 3 blocks
    a.allocate("y", [2], 16, 0)  # 1 block
    assert not a.can_admit(16)  # no free slot
    assert a.can_admit(16, freeing=[1]) and not a.can_admit(48, freeing=[1])  # 3 + 3 blocks > 5
    assert a.can_admit(48, freeing=[0]) and a.can_admit(1000, freeing=[0, 1])  # capped at max_seq_len
    assert a.occupied == 2 and a.reserved_blocks == 4  # asking frees nothing


def test_move_relocates_and_keeps_the_source_cached():
    a = KVCacheArena(num_slots=3, max_seq_len=64, block_size=4)
    for name, tok in (("a", 1), ("b", 2), ("c", 3)):
        s, _ = a.allocate(name, [tok], 8, 0)
        a.append(s, [tok] * 5)
    a.take_pending()
    a.free(0)
    a.move(2, 0)
    ops = a.take_pending()
    assert [(o.kind, o.src, o.dst, o.length) for o in ops] == [("copy", 2, 0, 5)]
    assert a.owner == ["c", "b", None] and a.reserved == [2, 2, 0] and a.tokens[0] == [3] * 5
    assert a.lookup([3] * 6, 5) == (2, 5)  # a free slot is preferred: taking it needs no copy
    a.free(0)
    assert a.lookup([3] * 6, 5) == (0, 5)


def test_prefix_lookup_uses_full_block_hashes_and_extends():
    a = KVCacheArena(num_slots=3, max_seq_len=64, block_size=4, prefix_cache=True)
    a.allocate("x", [5] * 3, 8, 2)  # slot 0 stays busy
    sys_prompt = list(range(10, 20))  # 10 tokens: 2 full blocks + 2
    s, reused = a.allocate("a", sys_prompt + [50, 51], 20, 11)
    assert (s, reused) == (1, 0)
    a.append(s, sys_prompt + [50, 51])
    a.free(s)  # finished: its KV stays cached
    slot, n = a.lookup(sys_prompt + [60], max_reuse=10)
    assert (slot, n) == (1, 10)  # 8 from block hashes + 2 from comparing the rest
    assert a.lookup([99] + sys_prompt, max_reuse=10) == (-1, 0)
    assert a.lookup(sys_prompt, max_reuse=5)[1] == 5  # capped (the last prompt token must still run)
    a.take_pending()
    s2, reused = a.allocate("b", sys_prompt + [60, 61], 20, 11, lowest=1)
    assert (s2, reused) == (1, 10) and a.prefix_hits == 1  # the cached slot is taken as is
    assert a.take_pending() == []  # no copy, no reset
    a.free(s2)
    assert a.allocate("c", sys_prompt + [60], 20, 10)[1] == 9  # never leaves a 1-token prefill


def test_a_salted_prefix_is_found_only_under_the_same_salt_and_adapter():
    """vLLM's cache_salt: the salt joins the namespace, so its chain's first block hash (and every later one) differs
    from another salt's, no salt's, and an adapter whose name spells the salt."""
    a = KVCacheArena(num_slots=3, max_seq_len=64, block_size=4, prefix_cache=True)
    prompt = list(range(10, 22))
    assert salted("", None) == "" and salted("x", "s") != salted("", "s") != "s"
    s, _ = a.allocate("a", prompt, 20, 11, namespace=salted("", "tenant-a"))
    a.append(s, prompt)
    a.free(s)
    assert a.lookup(prompt, 11, salted("", "tenant-a")) == (s, 11)
    for other in ("", salted("", "tenant-b"), "tenant-a", salted("tenant-a", None), salted("x", "tenant-a")):
        assert a.lookup(prompt, 11, other) == (-1, 0), other
    assert a.allocate("b", prompt, 20, 11, namespace=salted("", "tenant-b"))[1] == 0 and a.prefix_hits == 0


def test_only_prefill_written_kv_is_shared():
    a = KVCacheArena(num_slots=2, max_seq_len=64, block_size=4)
    s, _ = a.allocate("a", list(range(10)), 20, 9)
    a.append(s, list(range(10)))  # prefill
    a.append(s, [50, 51, 52, 53, 54, 55], shareable=False)  # decode
    assert a.lookup(list(range(10)) + [50, 51, 52, 53, 54, 55, 99], 100) == (s, 10)
    a.move(s, 1)
    assert a.shared[1] == 10 and a.lookup(list(range(10)) + [50, 51, 52], 100)[1] == 10
    a.truncate(1, 8)
    assert a.shared[1] == 8


def test_prefix_copied_from_a_running_slot():
    a = KVCacheArena(num_slots=2, max_seq_len=64, block_size=4)
    s0, _ = a.allocate("a", list(range(12)), 20, 11)
    a.append(s0, list(range(12)))
    a.take_pending()
    s1, reused = a.allocate("b", list(range(8)) + [77, 78], 20, 9)
    assert (s1, reused) == (1, 8)
    ops = a.take_pending()
    assert [(o.kind, o.src, o.dst, o.length) for o in ops] == [("copy", 0, 1, 8)]
    assert a.tokens[1] == list(range(8))


def test_no_prefix_cache_resets_slot():
    a = KVCacheArena(num_slots=1, max_seq_len=32, block_size=4, prefix_cache=False)
    s, _ = a.allocate("a", [1] * 8, 10, 7)
    a.append(s, [1] * 8)
    a.free(s)
    a.take_pending()
    s, reused = a.allocate("b", [1] * 8, 10, 7)
    assert reused == 0 and [o.kind for o in a.take_pending()] == ["reset"]


def test_a_request_reusing_nothing_takes_the_least_valuable_free_slot():
    """Empty slots first, then the least recently used (given out, hit or released), never simply the lowest: a
    recently used prefix survives unrelated requests while free slots can hold it."""
    a = KVCacheArena(num_slots=3, max_seq_len=64, block_size=4)

    def serve(prompt: list[int]) -> tuple[int, int]:
        s, reused = a.allocate(prompt[0], prompt, 20, len(prompt) - 1)
        a.append(s, prompt[reused:])
        a.free(s)
        return s, reused

    p, q, r = ([k] * 8 for k in (10, 20, 30))
    assert [serve(x) for x in (p, q)] == [(0, 0), (1, 0)]  # empty slots, lowest first
    assert serve(p + [11]) == (0, 7)  # a hit: p is now the most recently used
    assert serve(r) == (2, 0) and serve([40] * 8) == (1, 0)  # q was the least recently used
    assert serve(p + [12])[1] == 7 and serve(r + [31])[1] == 7
    off = KVCacheArena(num_slots=3, max_seq_len=64, block_size=4, prefix_cache=False)
    for k in (1, 2):
        off.append(off.allocate(k, [k] * 8, 20, 7)[0], [k] * 8)
    off.free(1)
    off.free(0)
    assert off.allocate(3, [3] * 8, 20, 7) == (0, 0)  # without the prefix cache nothing is worth keeping: the lowest


def test_beside_the_running_requests_only_among_slots_worth_the_same():
    """``near`` (a backend decoding one range of slots): a free slot beside the running requests joins their batch
    without a move, but an empty slot anywhere still goes before a cached prefix beside them."""
    a = KVCacheArena(num_slots=5, max_seq_len=64, block_size=4)
    for k in range(4):  # slots 0..3 cache a prefix each, 0 the least recently used; slot 4 is empty
        a.append(a.allocate(k, [k] * 8, 20, 0)[0], [k] * 8)
    for k in range(4):
        a.free(k)
    assert a.allocate("running", [9] * 8, 20, 0) == (4, 0)  # the empty slot
    assert a.victim(near=(4, 4)) == 3 and a.victim() == 0  # beside it, else the least recently used
    a.append(4, [9] * 8)
    a.free(4)
    a.allocate("running", [1] * 8 + [9], 20, 8)  # in slot 1, reusing its prefix: 0 and 2 are beside it
    assert a.victim(near=(1, 1)) == 0
    a.truncate(4, 0)  # slot 4 holds nothing now: it goes first, beside the running request or not
    assert a.victim(near=(1, 1)) == a.victim() == 4


def test_a_finished_answer_is_settled_into_the_shared_run():
    """A request's answer was decode-written (not shared); prefill chunks recomputing it from its ids make it
    reusable, its last token too (no step wrote that one's KV)."""
    a = KVCacheArena(num_slots=2, max_seq_len=64, block_size=4)
    s, _ = a.allocate("r", [1] * 6, 16, 0)
    a.append(s, [1] * 6)  # the prompt's prefill
    a.append(s, [5], shareable=False)  # decode steps fed the first 3 of 4 generated tokens
    a.append(s, [6], shareable=False)
    a.append(s, [7], shareable=False)
    a.free(s)
    a.keep_answer(s, [1] * 6 + [5, 6, 7, 8])
    assert a.lookup([1] * 6 + [5, 6, 7, 8, 9], 64) == (s, 6)
    assert a.next_unsettled() == s and a.unsettled[s][a.shared[s]:] == [5, 6, 7, 8]
    a.settled(s, 6, [5, 6])
    assert a.lookup([1] * 6 + [5, 6, 7, 8, 9], 64) == (s, 8) and a.next_unsettled() == s
    a.settled(s, 8, [7, 8])
    assert a.lookup([1] * 6 + [5, 6, 7, 8, 9], 64) == (s, 10) and a.next_unsettled() is None
    assert a.tokens[s] == [1] * 6 + [5, 6, 7, 8]


def test_a_settle_landing_after_its_slot_was_given_out_is_ignored():
    a = KVCacheArena(num_slots=1, max_seq_len=64, block_size=4)
    s, _ = a.allocate("r", [1] * 6, 16, 0)
    a.append(s, [1] * 6)
    a.append(s, [5], shareable=False)
    a.free(s)
    a.keep_answer(s, [1] * 6 + [5, 6])
    a.keep_answer(s, [9] * 8)  # ids that are not the slot's: never noted
    assert a.unsettled[s] == [1] * 6 + [5, 6]
    a.allocate("next", [2] * 5, 16, 4)
    assert a.next_unsettled() is None and s not in a.unsettled
    a.settled(s, 6, [5, 6])
    assert a.tokens[s] == [] and a.shared[s] == 0
    a.append(s, [2] * 5)
    a.free(s)
    a.keep_answer(s, [2] * 5 + [3])  # one id past the shared run: not worth a chunk (never 1 token)
    assert not a.unsettled

"""The prefix-affinity router's block keys: a key stands for everything up to the end of its
block, so two prompts share exactly the keys of their common whole blocks. (Its routing runs
end to end in test_faults.py, on two real target replicas.)"""

from specserve.ingress.prefix_affinity import block_keys


def test_block_keys_chain_so_prompts_share_the_keys_of_their_common_whole_blocks():
    base = list(range(100))
    keys = block_keys(base, 32)
    assert len(keys) == 3                                   # the last 4 tokens are no whole block
    assert block_keys(base[:64], 32) == keys[:2]
    assert block_keys(base + [7] * 40, 32)[:3] == keys      # a longer prompt extends the chain
    changed = block_keys([999] + base[1:], 32)               # the first token differs ...
    assert all(a != b for a, b in zip(changed, keys))       # ... so every later key differs too
    later = block_keys(base[:40] + [999] + base[41:], 32)   # a change in block 2 keeps block 1's key
    assert later[0] == keys[0] and later[1:] != keys[1:]
    assert block_keys(base[:31], 32) == []

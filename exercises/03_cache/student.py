"""Exercise 3: the cache. Write write and commit below (they become model.KVCache's methods);
check them with

    python -m exercises check 3

The statement is in README.md beside this file."""
import torch


def write(cache, layer_idx, k, v, pos):
    """Store one layer's keys and values of a block, and return that layer's whole buffers.

    cache: a model.KVCache: cache.k, cache.v (n_layer, B, n_head, max_len, head_dim) preallocated
        buffers, cache.lengths (B,) the committed tokens of each row.
    k, v (B, n_head, L, head_dim): the block's keys and values at layer layer_idx, in the model's
        compute dtype (the cache keeps its own: write them in cache.k.dtype).
    pos (B, L): where each row's block goes in the buffer (row b: cache.lengths[b] + 0..L-1).
    Returns (K, V), each (B, n_head, max_len, head_dim): the layer's buffers after the write.
    Write in place, at the positions and nowhere else: nothing concatenated, nothing allocated per
    step; cache.k and cache.v stay the same tensors, and K, V are cache.k[layer_idx],
    cache.v[layer_idx].
    """
    raise NotImplementedError("exercise 3: write `write` in exercises/03_cache/student.py (in a handout, "
                              "every decode runs on the cache: generate.py, train.py, the checks that decode)")


def commit(cache, n):
    """Keep the first n (B,) tokens (or an int for every row) of the block just written: they
    become part of each row's sequence. The entries past them stay in the buffer until the next
    block overwrites them. In place: cache.lengths stays the same tensor (+=, not a new one)."""
    raise NotImplementedError("exercise 3: write `commit` in exercises/03_cache/student.py")

"""Exercise 3's reference is the project's own model.KVCache.write and commit; these are the
plausible wrong answers its checks must catch."""
import torch

from model import KVCache

project_write = KVCache.write     # taken before a check plugs anything in


def same_length_for_every_row(cache, n):
    cache.lengths += torch.as_tensor(n).max()          # the longest row's n for every row


def write_at_the_start(cache, layer_idx, k, v, pos):
    at = torch.arange(k.size(2))                        # ignores where the rows are
    cache.k[layer_idx][:, :, at] = k.to(cache.k.dtype)
    cache.v[layer_idx][:, :, at] = v.to(cache.v.dtype)
    return cache.k[layer_idx], cache.v[layer_idx]


def every_row_at_row_0s_positions(cache, layer_idx, k, v, pos):
    return project_write(cache, layer_idx, k, v, pos[:1].expand_as(pos))   # one row's positions for all


def lengths_rebound(cache, n):
    cache.lengths = cache.lengths + n                   # the right values, in a new tensor


def buffers_rebuilt(cache, layer_idx, k, v, pos):
    idx = pos[:, None, :, None].expand(-1, k.size(1), -1, k.size(3))                # (B, nh, L, hs)
    for name, new in (('k', k), ('v', v)):
        buf = getattr(cache, name)
        layer = buf[layer_idx].scatter(2, idx, new.to(buf.dtype))                     # scatter, not scatter_
        setattr(cache, name, torch.cat([buf[:layer_idx], layer[None], buf[layer_idx + 1:]]))
    return cache.k[layer_idx], cache.v[layer_idx]


def layer_rebuilt_and_copied_back(cache, layer_idx, k, v, pos):
    idx = pos[:, None, :, None].expand(-1, k.size(1), -1, k.size(3))                # (B, nh, L, hs)
    for buf, new in ((cache.k, k), (cache.v, v)):
        layer = buf[layer_idx].scatter(2, idx, new.to(buf.dtype))                  # a whole layer, new
        buf[layer_idx].copy_(layer)                                                 # right values and address
    return cache.k[layer_idx], cache.v[layer_idx]


def commit_of_an_int_on_the_cpu(cache, n):
    if not isinstance(n, torch.Tensor):
        n = torch.full(cache.lengths.shape, n)          # no device=: the CPU's, wherever the cache is
    cache.lengths += n


def write_rows_indexed_from_the_cpu(cache, layer_idx, k, v, pos):
    rows = torch.arange(pos.size(0))[:, None]           # no device=: on a GPU, copied from the host at every write
    cache.k[layer_idx][rows, :, pos] = k.transpose(1, 2).to(cache.k.dtype)     # (B, L, nh, hs)
    cache.v[layer_idx][rows, :, pos] = v.transpose(1, 2).to(cache.v.dtype)
    return cache.k[layer_idx], cache.v[layer_idx]


def commit_zeroes_the_refused(cache, n):
    cache.lengths += n
    past = torch.arange(cache.max_len, device=cache.lengths.device) >= cache.lengths[:, None]   # (B, max_len)
    for buf in (cache.k, cache.v):                      # a rollback: every layer, the whole cache, each step
        buf.masked_fill_(past[None, :, None, :, None], 0.0)


def write_squeezed(cache, layer_idx, k, v, pos):
    at = (cache.layers[layer_idx], cache.rows, slice(None), pos)
    cache.k[at] = k.transpose(1, 2).squeeze().to(cache.k.dtype)      # one token: (B, nh, hs), not (B, 1, nh, hs)
    cache.v[at] = v.transpose(1, 2).squeeze().to(cache.v.dtype)
    return cache.k[layer_idx], cache.v[layer_idx]


def write_by_a_mean_reduction(cache, layer_idx, k, v, pos):
    idx = pos[:, None, :, None].expand(-1, k.size(1), -1, k.size(3))             # (B, nh, L, hs)
    for buf, new in ((cache.k, k), (cache.v, v)):   # right values; inside, a count per slot of the layer
        buf[layer_idx].scatter_reduce_(2, idx, new.to(buf.dtype), 'mean', include_self=False)
    return cache.k[layer_idx], cache.v[layer_idx]


def write_in_float64(cache, layer_idx, k, v, pos):
    at = (cache.layers[layer_idx], cache.rows, slice(None), pos)
    cache.k[at] = k.transpose(1, 2).double()         # the checks' dtype, not the cache's
    cache.v[at] = v.transpose(1, 2).double()
    return cache.k[layer_idx], cache.v[layer_idx]


def write_clears_past_the_block(cache, layer_idx, k, v, pos):
    past = (torch.arange(cache.max_len, device=pos.device) > pos[:, -1:])[:, None, :, None]   # (B, 1, max_len, 1)
    for buf in (cache.k, cache.v):                  # the rollback, moved from commit into every write
        buf[layer_idx].masked_fill_(past, 0.0)
    return project_write(cache, layer_idx, k, v, pos)


def commit_of_an_int_copied_to_the_device(cache, n):
    cache.lengths += torch.tensor(n, device=cache.lengths.device) if isinstance(n, int) else n   # a copy, a sync


def write_without_a_cast(cache, layer_idx, k, v, pos):
    at = (cache.layers[layer_idx], cache.rows, slice(None), pos)
    cache.k[at] = k.transpose(1, 2)                  # in k's dtype: refused by a cache of another
    cache.v[at] = v.transpose(1, 2)
    return cache.k[layer_idx], cache.v[layer_idx]


def commit_of_an_int_sent_to_the_device(cache, n):
    cache.lengths += torch.tensor(n).to(cache.lengths.device) if isinstance(n, int) else n   # a copy, a sync


block_index = {}


def write_index_keyed_on_the_blocks_shape(cache, layer_idx, k, v, pos):
    key = (tuple(pos.shape), cache.k.device)     # rows and length: not the heads or the head size
    if key not in block_index:
        block_index[key] = torch.empty(k.shape, dtype=torch.long, device=cache.k.device)
    idx = block_index[key]                      # another model's cache (a draft model's) gets this one's
    idx.copy_(pos[:, None, :, None].expand_as(idx))
    for buf, new in ((cache.k, k), (cache.v, v)):
        buf[layer_idx].scatter_(2, idx, new.to(buf.dtype))
    return cache.k[layer_idx], cache.v[layer_idx]


def write_keeps_every_blocks_positions(cache, layer_idx, k, v, pos):
    if layer_idx == 0:                          # "to debug": a tensor that grows with the tokens decoded
        cache.written = torch.cat([getattr(cache, 'written', pos[:, :0]), pos], 1)
    return project_write(cache, layer_idx, k, v, pos)


def commit_keeps_every_n(cache, n):
    cache.__dict__.setdefault('history', []).append(n)      # every step's n, kept: grows with the tokens decoded
    cache.lengths += n


def commit_reseeds_the_global_rng(cache, n):
    torch.manual_seed(0)                                # "reproducible steps": the caller's RNG reseeded
    cache.lengths += n


def write_sets_the_default_dtype(cache, layer_idx, k, v, pos):
    torch.set_default_dtype(cache.k.dtype)              # "so that new tensors match the cache": process-wide
    return project_write(cache, layer_idx, k, v, pos)


CONTROLS = {
    'commits the same length for every row': dict(commit=same_length_for_every_row),
    'writes the block at the start of the buffer': dict(write=write_at_the_start),
    "writes every row at row 0's positions": dict(write=every_row_at_row_0s_positions),
    'commit rebinds the lengths to a new tensor': dict(commit=lengths_rebound),
    'write rebuilds the buffers (torch.cat of the layers)': dict(write=buffers_rebuilt),
    'write builds the layer anew and copies it back': dict(write=layer_rebuilt_and_copied_back),
    'commit of an int makes its tensor on the CPU': dict(commit=commit_of_an_int_on_the_cpu),
    'commit zeroes the refused entries (a rollback)': dict(commit=commit_zeroes_the_refused),
    "write's row indices are made on the CPU": dict(write=write_rows_indexed_from_the_cpu),
    'write squeezes every dimension (a block of one token)': dict(write=write_squeezed),
    "write by scatter_reduce_ 'mean' (a count of the layer's size inside it)": dict(write=write_by_a_mean_reduction),
    "write in float64 whatever the cache's dtype": dict(write=write_in_float64),
    'write clears the slots past the block (the rollback moved there)': dict(write=write_clears_past_the_block),
    'commit of an int copied to the device (torch.tensor(n, device=...))': dict(
        commit=commit_of_an_int_copied_to_the_device),
    "write in k's own dtype, not the cache's (no cast)": dict(write=write_without_a_cast),
    'commit of an int sent to the device by .to() (torch.tensor(n).to(device))': dict(
        commit=commit_of_an_int_sent_to_the_device),
    "write's index kept by the block's shape alone (a draft model's cache gets the target's)": dict(
        write=write_index_keyed_on_the_blocks_shape),
    "write keeps every block's positions (torch.cat onto the cache: grows with the tokens decoded)": dict(
        write=write_keeps_every_blocks_positions),
    "commit keeps every n in a list on the cache (grows with the tokens decoded)": dict(commit=commit_keeps_every_n),
    "commit calls torch.manual_seed (the caller's global RNG reseeded at every step)": dict(
        commit=commit_reseeds_the_global_rng),
    "write sets torch's default dtype to the cache's (a process-wide setting left changed)": dict(
        write=write_sets_the_default_dtype),
}

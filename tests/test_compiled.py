"""The compiled merged step equals the eager one (on CUDA when present, else on the CPU), and
on CUDA a step makes no host sync (skipped without a GPU: CI has none)."""
import pytest
import torch

from dblast import DBlastDrafter
from decode import generate, merged_step, sample
from heads import BlockHeads
from model import GPT, GPTConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


DEV = 'cuda' if torch.cuda.is_available() else 'cpu'


def setup(kind, temperature):
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=128, vocab_size=64, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg).to(DEV).eval()
    if kind == 'heads':
        drafter = BlockHeads(cfg, 4)
        torch.nn.init.normal_(drafter.c_proj.weight, std=0.2)
    else:
        drafter = DBlastDrafter(cfg, 4, 4)
        drafter.sample_drafts = temperature > 0
    return model, drafter.to(DEV).eval()


@cuda
@pytest.mark.parametrize('temperature', [0.0, 1.0])
@pytest.mark.parametrize('kind', ['heads', 'dblast'])
def test_merged_step_does_not_sync(kind, temperature):
    model, drafter = setup(kind, temperature)
    g = torch.Generator(device='cuda').manual_seed(0)
    B, k = 4, 4
    prompt = torch.randint(64, (B, 8), device='cuda')
    cache = model.new_cache(B, 64)
    with torch.no_grad():
        h = model.forward_cached(prompt, cache)[:, -1]
        cache.lengths += 8
        bonus = sample(torch.softmax(model.lm_head(h), -1), g)
        drafts, q = drafter.draft(h, bonus, model, k, temperature, g)
        block = torch.cat([bonus[:, None], drafts], 1)
        active = torch.ones(B, dtype=torch.bool, device='cuda')
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode('error')   # any host sync inside raises
        try:
            for _ in range(5):
                n_acc, accepted, block, q = merged_step(model, drafter, cache, block, q, active,
                                                        temperature, ('exact', 0), g)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert int(cache.lengths.min()) >= 8 + 5


def test_compiled_generate_matches_eager():
    model, drafter = setup('heads', 0.0)
    prompt = torch.randint(64, (3, 8), device=DEV)
    eager, s1 = generate(model, prompt, 40, drafter=drafter, k=4)
    for _ in range(2):  # the first call compiles and records the graphs
        compiled, s2 = generate(model, prompt, 40, drafter=drafter, k=4, compile=True)
    assert torch.equal(eager, compiled) and s1['accept_lengths'] == s2['accept_lengths']

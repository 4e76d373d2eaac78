"""
What decode.generate accepts: every user error it can meet, checked before any work and raised as
one line (cli.BadInput) that names the argument (its flag, from generate.py), what was given and
what is allowed. None of it is the algorithm; decode.py calls `check_args` first, then reads the
acceptance rule (verification.parse_accept, beside its table) and `check_accept` checks it here.

A setting that means nothing here is refused too (k without a drafter, several paths with a
drafter that drafts one), and a drafter has its own word on what means nothing to it
(heads.Drafter.meaningless) and on whether it fits the target (heads.Drafter.does_not_fit).
"""
import torch

from cli import BadInput, check_number
from data import describe, is_real, is_whole
from heads import Drafter, tree_size
from model import GPT

MAX_PATHS = 64   # drafted paths per call: the block is 1 + paths * (k-1) tokens
MAX_NODES = 1024   # drafted tokens of a tree per call: the block is 1 + nodes tokens
# nodes x (k-1): the drafted positions a tree's growth may score per call, up to `nodes` at each of
# its k-1 depths (a draft model feeds each depth's prefixes as chains, drafters.DraftModel.next_log_q)
MAX_TREE = 16 * MAX_NODES


def named(name, value, cli=False):
    """How an error names what the user gave: 'k=9' to a Python caller, '--k 9' on the command line
    (a switch as itself: '--no-sample-drafts'; a tuple as typed: '--branching 4,4,4')."""
    flag = name.replace('_', '-')
    if cli and isinstance(value, bool):
        return f"--{'' if value else 'no-'}{flag}"
    if cli and isinstance(value, tuple):   # as typed: --branching 4,4,4
        value = ','.join(map(str, value))
    return f"--{flag} {value}" if cli else f"{name}={value!r}"


def check_args(model, prompt, max_new_tokens, drafter=None, k=None, temperature=0.0, cli=False, paths=1,
               generator=None, compile=False, threads=None, nodes=None, branching=None):
    """Every user error of generate()'s arguments but the acceptance rule (check_accept), as
    a one-line BadInput naming the argument (the command-line flag when cli=True). Returns k: the
    drafter's when None, 1 for plain decoding."""
    def say(name, value):
        return named(name, value, cli)

    if not isinstance(model, GPT):
        raise BadInput(f"model is {describe(model)}; want a model.GPT (data.load_target)")
    check_prompt(model, prompt)
    if not is_whole(max_new_tokens, 1):
        raise BadInput(f"{say('max_new_tokens', max_new_tokens)}: want a whole number >= 1")
    limit = model.config.block_size
    if prompt.size(1) + max_new_tokens > limit:
        raise BadInput(f"{say('max_new_tokens', max_new_tokens)}: the prompt ({prompt.size(1)} tokens) "
                       f"and {max_new_tokens} new tokens exceed the model's context of {limit} tokens")
    if not is_real(temperature):
        raise BadInput(f"{say('temperature', temperature)}: want a number >= 0 (0 = greedy)")
    check_number('--temperature' if cli else 'temperature', temperature, lo=0.0, note='0 = greedy')
    if not is_whole(paths, 1, MAX_PATHS):
        raise BadInput(f"{say('paths', paths)}: drafted paths per call, a whole number from 1 to {MAX_PATHS}")
    if nodes is not None and not is_whole(nodes, 1, MAX_NODES):
        raise BadInput(f"{say('nodes', nodes)}: drafted tokens of a tree per call, a whole number from 1 to "
                       f"{MAX_NODES}")
    if nodes is not None and paths != 1:
        raise BadInput(f"{say('nodes', nodes)} and {say('paths', paths)}: a call verifies one tree or several paths, "
                       f"not both")
    tree = ('nodes', nodes, nodes)   # a tree's argument, as given, and its drafted tokens
    if branching is not None:
        tree = ('branching', branching, check_branching(branching, nodes, paths, temperature, model.config.vocab_size,
                                                        say))
    if drafter is None:
        if k is not None:
            raise BadInput(f"{say('k', k)} means nothing without a drafter: plain decoding takes the target's own "
                           f"token, one a call")
        for name, value, default, what in (('paths', paths, 1, 'several paths need'),
                                           tree[:2] + (None, 'a tree needs')):
            if value != default:
                raise BadInput(f"{say(name, value)}: {what} a drafter "
                               + ("(--heads, --drafter, --draft-model or --lookup)" if cli else "(drafter=...)"))
        k = 1
    else:
        k = check_drafter(model, drafter, k, paths, tree, say)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise BadInput(f"generator is {describe(generator)}; want a torch.Generator or None")
    if generator is not None and generator.device.type != prompt.device.type:
        raise BadInput(f"the generator is on {generator.device}, the prompt on {prompt.device}: make it with "
                       f"torch.Generator(device=...) on the prompt's device")
    if not isinstance(compile, bool):
        raise BadInput(f"compile={compile!r}: want True or False")
    if not (threads in (None, 'auto') or is_whole(threads, 1, 1024)):
        raise BadInput(f"threads={threads!r}: want 'auto', None (torch's setting as it is) or a whole number from 1 "
                       f"to 1024")
    if isinstance(drafter, Drafter):
        for setting, value, why in drafter.meaningless(temperature, paths):
            raise BadInput(f"{say(setting, value)} means nothing here: {why}")
    return k


def check_prompt(model, prompt):
    """A prompt is token ids (B, T) of the model's vocabulary, on its device."""
    if not isinstance(prompt, torch.Tensor):
        raise BadInput(f"prompt is {describe(prompt)}; want a tensor of token ids (B, T), one row per prompt: "
                       f"torch.tensor([ids])")
    if prompt.dim() != 2:
        raise BadInput(f"prompt has shape {tuple(prompt.shape)}; want (B, T), one row per prompt"
                       + (f": prompt[None] is one row of {prompt.size(0)} tokens" if prompt.dim() == 1 else ''))
    if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
        raise BadInput(f"prompt is a {prompt.dtype} tensor; want integer token ids (torch.long)")
    if prompt.numel() == 0:
        raise BadInput(f"prompt is empty (shape {tuple(prompt.shape)}): give at least one row of at least one token")
    device = model.lm_head.weight.device
    if prompt.device != device:
        raise BadInput(f"prompt is on {prompt.device}, the model on {device}: put them on one device")
    V = model.config.vocab_size
    lo, hi = int(prompt.min()), int(prompt.max())   # one read from the device, before any work
    if lo < 0 or hi >= V:
        raise BadInput(f"prompt holds token id {lo if lo < 0 else hi}; the model's vocabulary has ids 0..{V - 1}")


def check_branching(branching, nodes, paths, temperature, V, say):
    """A sampled tree's widths, one a drafted position (k-1 of them: check_drafter), apart from the
    drafter; V the vocabulary's size. Returns its drafted tokens (heads.tree_size)."""
    if not (isinstance(branching, (tuple, list)) and branching and all(is_whole(b, 1) for b in branching)):
        raise BadInput(f"{say('branching', branching)}: want the children of the tree's spine at each drafted "
                       f"position, whole numbers >= 1: (4, 4, 4)")
    if nodes is not None or paths != 1:
        raise BadInput(f"{say('branching', branching)}: a call verifies a sampled tree (branching), a best-first one "
                       f"(nodes) or several paths (paths), one of them")
    if temperature == 0:
        raise BadInput(f"{say('branching', branching)}: a sampled tree is for sampling (temperature > 0); greedy "
                       f"decoding grows a best-first tree (nodes)")
    size = tree_size(branching)
    if size > MAX_NODES:
        raise BadInput(f"{say('branching', branching)}: a tree of {size} drafted tokens; at most {MAX_NODES}")
    if max(branching) > V:
        raise BadInput(f"{say('branching', branching)}: a node has at most as many children as the vocabulary "
                       f"has tokens, {V}")
    return size


def check_drafter(model, drafter, k, paths, tree, say):
    """A drafter of the contract (heads.Drafter) that fits the model, k within what it drafts, and
    what paths and a tree ask of it: tree = (its argument's name, its value, its drafted tokens).
    Returns k (the drafter's when None)."""
    name, value, nodes = tree
    if not (callable(getattr(drafter, 'draft', None)) and is_whole(getattr(drafter, 'k', None), 2)):
        raise BadInput(f"drafter is {describe(drafter)}; want a drafter (heads.Drafter: its k and draft)")
    device = model.lm_head.weight.device
    weights = next(drafter.parameters(), None) if isinstance(drafter, torch.nn.Module) else None
    if weights is not None and weights.device != device:
        raise BadInput(f"the drafter is on {weights.device}, the model on {device}: load it with "
                       f"drafters.load_drafter(path, model), or move it")
    why = drafter.does_not_fit(model) if isinstance(drafter, Drafter) else None
    if why:
        raise BadInput(f"the drafter does not fit this target: {why}")
    k = drafter.k if k is None else k
    if not is_whole(k):
        raise BadInput(f"{say('k', k)}: want a whole number from 2 to the drafter's {drafter.k}")
    if k < 2:
        raise BadInput(f"{say('k', k)}: a drafter needs k >= 2 (1 bonus + at least one draft)")
    if k > drafter.k:
        raise BadInput(f"{say('k', k)}: the drafter was trained for k <= {drafter.k}")
    limit = model.config.block_size
    if k > limit:   # a drafter that drafts any length (prompt lookup, a draft model) is given its k
        raise BadInput(f"{say('k', k)}: a block of k tokens would be longer than the model's context of {limit} "
                       f"tokens")
    if name == 'branching' and len(value) != k - 1:
        raise BadInput(f"{say(name, value)} at {say('k', k)}: want one width a drafted position, k-1 = {k - 1} of "
                       f"them")
    if nodes is not None and nodes * (k - 1) > MAX_TREE:
        raise BadInput(f"{say('nodes', nodes)} at {say('k', k)}: growing a tree scores up to nodes x (k-1) = "
                       f"{nodes * (k - 1)} drafted positions a call, more than {MAX_TREE}; use fewer nodes or a "
                       f"smaller k")
    if paths > 1 and not callable(getattr(drafter, 'draft_paths', None)):
        raise BadInput(f"{say('paths', paths)}: this drafter drafts one path a call (no draft_paths: heads.Drafter's)")
    if nodes is not None and getattr(type(drafter), 'next_log_q', Drafter.next_log_q) is Drafter.next_log_q:
        raise BadInput(f"{say(name, value)}: this drafter grows no token trees (no next_log_q of its own: "
                       f"heads.Drafter's)")
    return k


def check_accept(accept, param, temperature, drafter, k, nodes, cli=False):
    """The acceptance rule `accept` (its text; param: its N, as verification.parse_accept read it) against
    the other settings, k the block's: every rule but 'exact' is lossy, so greedy-only, and judges
    one block."""
    say, lossy = named('accept', accept, cli), accept != 'exact'
    if lossy and drafter is None:
        raise BadInput(f"{say} means nothing without a drafter: plain decoding takes the target's own token, one a "
                       f"call")
    if lossy and temperature > 0:
        raise BadInput(f"{say} is lossy and greedy-only; with temperature > 0 use exact acceptance")
    if lossy and nodes is not None:
        raise BadInput(f"{say} with {named('nodes', nodes, cli)}: a tree is walked with the target's own choices, "
                       f"exactly; the lossy rules judge one block")
    if accept.startswith('minblock:') and param > k:   # it would take every draft and still not reach N
        raise BadInput(f"{say} at {named('k', k, cli)}: a step commits at most k = {k} tokens, so at least {param} "
                       f"cannot be kept; use minblock:N with N <= k (N = k takes every draft unverified)")

"""
What comes in from outside the program: checkpoint files, vocabularies, corpora and held-out
prompts, for generate.py, train.py and bench.py alike. Every user error is a `BadInput` (cli.py,
with the rest of what the command lines share), which the scripts print as one `error:` line.

Checkpoints (`load_checkpoint`, `save_checkpoint`, `load_target`): written atomically (an
interrupted or failed write leaves no temporary file and the previous checkpoint as it was:
cli.write_atomically), read with `weights_only=True` (tensors and plain values only: nothing in a
file runs), every field checked for type and range before it is used (`FIELDS`), a target's config
checked against the weights the file holds (their element counts) before any tensor is made,
finite weights only.

Vocabularies (`Vocab`):
  bytes   UTF-8 bytes, 256 ids: this project's own models (the default)
  char    a nanoGPT character vocabulary, from its meta.pkl (stoi / itos); read without running code
  gpt2    GPT-2 BPE through tiktoken (optional; 50257 / 50304-vocabulary checkpoints)
A target's vocabulary is found as nanoGPT's sample.py finds it (`vocab_for`), recorded in every
checkpoint this project writes, and checked wherever text or a dataset becomes ids.

Corpora (`load_dataset`): a text file or folder of text files (bytes; by default the Python
standard library), or a nanoGPT dataset folder: train.bin / val.bin (uint16 ids) and optionally
meta.pkl. `heldout_prompts_of(out_dir)`: the held-out prompts train.py's closing demos decode, read
from its output folder without writing anything there.
"""
import dataclasses
import functools
import hashlib
import math
import os
import pickle
import stat
import sysconfig
from contextlib import suppress

import numpy as np
import torch

from cli import BadInput, first_line, pick_device, write_atomically
from model import GPT, GPTConfig

PROMPT_LEN = 32       # corpus prompt in front of each generated training sequence
DEMO_PROMPTS = 8      # held-out prompts of train.py's closing demos (heldout_prompts_of)
GPT2_SIZES = (50257, 50304)   # GPT-2's vocabulary, and nanoGPT's padded one


# ----------------------------------------------------------------------------- checkpoints

def check_finite(module, what):
    """Refuse weights with a NaN or an inf: they would decode garbage or poison a checkpoint."""
    bad = [n for n, t in module.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise BadInput(f"{what}: non-finite weights in {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else ''))


def save_checkpoint(obj, path):
    """torch.save, atomically (write_atomically): an interrupted or failed save leaves the previous
    checkpoint intact and no temporary file."""
    write_atomically(path, lambda tmp: torch.save(obj, tmp))


# numpy scalars, as a checkpoint may hold them (a learning rate computed with numpy, a loss): data
# whose unpickling runs nothing but numpy's own constructors, so weights_only loading allows them
NUMPY_SCALARS = [getattr(np, '_core', np.core).multiarray.scalar, np.dtype] + [
    type(np.dtype(t)) for t in (np.float64, np.float32, np.float16, np.int64, np.int32, np.bool_)]


def is_whole(v, lo=None, hi=None):
    """A whole number (an int or a numpy integer, not a bool) within [lo, hi]."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and (lo is None or v >= lo) \
        and (hi is None or v <= hi)


def is_real(v):
    """A finite number (numpy's included, not a bool)."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


def is_weights(v):
    return isinstance(v, dict) and all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in v.items())


def is_optimizer_state(v):
    """torch.optim's state_dict: {'state': {index: {name: tensor or number}}, 'param_groups': [{'params':
    [index, ...], ...}]}."""
    return (isinstance(v, dict) and isinstance(v.get('state'), dict) and isinstance(v.get('param_groups'), list)
            and all(isinstance(st, dict) and all(isinstance(x, (torch.Tensor, int, float)) for x in st.values())
                    for st in v['state'].values())
            and all(isinstance(g, dict) and isinstance(g.get('params'), list) and all(map(is_whole, g['params']))
                    for g in v['param_groups']))


def is_rng_record(v):
    """train.py's RNG states: {'gen': [...], 'torch': [...], 'dgen': [...]}, a uint8 state per rank."""
    return (isinstance(v, dict) and {'gen', 'torch'} <= set(v)
            and all(isinstance(v[n], list) and v[n] and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                                                           and t.dim() == 1 for t in v[n]) for n in v))


def is_config(v):
    """A run's recorded flags (vars(args) of train.py, nanoGPT's config): a dict whose data path, if
    any, is text (train.py's 'data', nanoGPT's 'dataset')."""
    return v is None or (isinstance(v, dict) and all(v.get(n) is None or isinstance(v[n], str)
                                                     for n in ('data', 'dataset')))


# Every field a checkpoint of this project or of nanoGPT may carry -> (test, what it must be).
# load_checkpoint applies the test to each field present before anything reads it; fields not
# named here are never read.
FIELDS = {
    'kind': (lambda v: isinstance(v, str), 'a name'),
    'model': (is_weights, 'a dict of tensors'),
    'drafter': (is_weights, 'a dict of tensors'),
    'joint_model': (lambda v: v is None or is_weights(v), 'None or a dict of tensors'),
    'model_args': (lambda v: isinstance(v, dict), 'a dict of the model\'s sizes'),
    'config': (is_config, 'a dict of flags whose data path is text'),
    'vocab': (lambda v: v is None or isinstance(v, dict), 'a vocabulary record'),
    'optimizer': (is_optimizer_state, "an optimizer's state_dict"),
    'iter_num': (lambda v: is_whole(v, 0), 'a whole number >= 0'),
    'rng': (is_rng_record, "train.py's RNG states (uint8 tensors per rank)"),
    'best_val_loss': (lambda v: v is None or is_real(v) or (isinstance(v, torch.Tensor) and v.numel() == 1),
                      'a number'),
    'k': (lambda v: is_whole(v, 2), 'a whole number >= 2'),
    'K': (lambda v: is_whole(v, 1), 'a whole number >= 1'),
    'd_hidden': (lambda v: is_whole(v, 1), 'a whole number >= 1'),
    'base_fingerprint': (lambda v: isinstance(v, str), 'a fingerprint (text)'),
    'trained_from': (lambda v: isinstance(v, str), 'a fingerprint (text)'),
    'joint': (lambda v: isinstance(v, bool), 'True or False'),
    'loss': (lambda v: isinstance(v, str), 'a loss name'),
    'temperature': (lambda v: is_real(v) and v > 0, 'a number > 0'),
    'history': (lambda v: isinstance(v, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and is_whole(p[0]) and is_real(p[1]) for p in v),
        'a list of (step, value) pairs'),
}


def describe(v):
    """A value as an error line quotes it: its type, and the value itself when short."""
    text = repr(v)
    return f"{type(v).__name__} {text}" if len(text) <= 40 else f"a {type(v).__name__}"


def odd_part(value, ok):
    """What is wrong with a field that fails its test `ok`, to quote: for a dict judged entry by entry
    (weights, flags) the first entry that fails ("holds 'lm_head.weight': str 'w'"), else the value
    itself ("is list [1, 2]")."""
    if isinstance(value, dict) and ok in (is_weights, is_config):
        for key, v in value.items():
            if not ok({key: v}):
                return f"holds {key!r}: {describe(v)}"
    return f"is {describe(value)}"


def check_path(path, what='path'):
    if not isinstance(path, (str, os.PathLike)):
        raise BadInput(f"{what} {describe(path)}: give a file name (str or os.PathLike)")
    if not os.fspath(path):
        raise BadInput(f"{what}: an empty file name; give the path of one")
    return os.fspath(path)


def folder_given(path):
    """The line for a folder given where a checkpoint file goes: what it is, and what to give."""
    with suppress(OSError):
        names = sorted(n for n in os.listdir(path) if n.endswith('.pt') and os.path.isfile(os.path.join(path, n)))
        if names:
            first = 'ckpt.pt' if 'ckpt.pt' in names else names[0]
            return (f"{path} is a folder; give a checkpoint file, e.g. {os.path.join(path, first)} (it holds "
                    f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''})")
    return f"{path} is a folder; give a checkpoint file (a .pt file, e.g. the ckpt.pt train.py writes), not a folder"


def load_checkpoint(path, kind=None):
    """torch.load with one-line errors for a missing, corrupt or wrong-kind file. Only tensors and
    plain Python values (and numpy scalars) load (weights_only=True): a file that needs more is
    refused, and nothing in it runs. Every field in FIELDS that the file carries is checked."""
    path = check_path(path, 'checkpoint')
    if os.path.isdir(path):
        raise BadInput(folder_given(path))
    if not os.path.isfile(path):
        if os.path.exists(path):    # a device, a pipe, a socket: reading it could block, or never end
            raise BadInput(f"checkpoint {path} is not a regular file; give a checkpoint file (the .pt train.py writes)")
        raise BadInput(f"checkpoint not found: {path}")
    head = first_bytes(path, 4)
    # torch.save writes a zip file ('PK'); its older format, and a pickle of protocol 2 or later,
    # begin with pickle's PROTO opcode (0x80). Anything else torch never saved: say so, not "refused"
    if head and not (head.startswith(b'PK') or head.startswith(b'\x80')):
        raise BadInput(f"{path} is not a PyTorch checkpoint (torch.save writes a zip file; this one begins "
                       f"{head!r}); give a checkpoint train.py wrote")
    try:
        with torch.serialization.safe_globals(NUMPY_SCALARS):
            ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as e:
        if 'Weights only load failed' in str(e):  # it names a class or function: refused unloaded
            raise BadInput(f"checkpoint {path} refused: it holds more than tensors and plain values "
                           f"(nothing in it was run)")
        raise BadInput(f"checkpoint {path} is unreadable ({type(e).__name__}); re-train or re-copy it")
    except Exception as e:  # truncated zip, pickle garbage, ...
        raise BadInput(f"checkpoint {path} is unreadable ({type(e).__name__}); re-train or re-copy it")
    if not isinstance(ckpt, dict):
        raise BadInput(f"checkpoint {path} is not a checkpoint dict")
    for name, (ok, want) in FIELDS.items():
        if name in ckpt and not ok(ckpt[name]):
            raise BadInput(f"checkpoint {path}: its {name!r} {odd_part(ckpt[name], ok)}; want {want}")
    if ckpt.get('vocab') is not None:
        Vocab.from_state(ckpt['vocab'], path)
    have = ckpt.get('kind', 'target')
    if kind is not None and have != kind:
        raise BadInput(f"checkpoint {path} holds a {have!r}, expected a {kind!r}")
    return ckpt


def first_bytes(path, n):
    """The first n bytes of the file at path (b'' for an empty one; None where it cannot be read:
    the reader that follows says why)."""
    try:
        with open(path, 'rb') as f:
            return f.read(n)
    except OSError:
        return None


def check_model_args(model_args, where):
    """A GPTConfig from a checkpoint's model_args (or train.py's flags), every size checked for type
    and range; a field it lacks takes GPTConfig's default, as nanoGPT's older files need."""
    if not isinstance(model_args, dict):
        raise BadInput(f"{where}: its model_args is {describe(model_args)}; want a dict of the model's sizes")
    for name in ('n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size'):
        if name in model_args and not is_whole(model_args[name], 1):
            raise BadInput(f"{where}: model_args {name} is {describe(model_args[name])}; want a whole number >= 1")
    if 'dropout' in model_args and not (is_real(model_args['dropout']) and 0 <= model_args['dropout'] < 1):
        raise BadInput(f"{where}: model_args dropout is {describe(model_args['dropout'])}; want a number in [0, 1)")
    if 'bias' in model_args and not isinstance(model_args['bias'], bool):
        raise BadInput(f"{where}: model_args bias is {describe(model_args['bias'])}; want True or False")
    config = GPTConfig.from_dict(model_args)
    if config.n_embd % config.n_head:
        raise BadInput(f"{where}: model_args n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
    return config


def config_of(ckpt, path):
    """The checked GPTConfig of a target checkpoint dict (check_model_args), without its weights."""
    if 'model_args' not in ckpt:
        raise BadInput(f"checkpoint {path} has no 'model_args': not a GPT checkpoint")
    return check_model_args(ckpt['model_args'], f"checkpoint {path}")


def weight_count(config):
    """How many weights GPT(config) holds, tied ones counted once per name as a state_dict lists them,
    by arithmetic: a one-layer model built on the meta device (no memory) gives what lies outside
    the layers and one layer's share."""
    with torch.device('meta'):
        one = GPT(dataclasses.replace(config, n_layer=1))
    sizes = {n: t.numel() for n, t in one.state_dict().items()}
    layer = sum(v for n, v in sizes.items() if n.startswith('transformer.h.0.'))
    return sum(sizes.values()) - layer + config.n_layer * layer


def gigabytes(n_bytes):
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.1f} MB" if n_bytes >= 1e5 \
        else f"{n_bytes / 1e3:.1f} kB"


def memory_free(device):
    """Bytes free on `device` now (CPU: MemAvailable of /proc/meminfo, else the free pages; CUDA: the
    driver's count), or None where this machine does not say."""
    kind = torch.device(device).type
    try:
        if kind == 'cuda':
            return torch.cuda.mem_get_info(torch.device(device))[0]
        if kind == 'cpu':
            with suppress(OSError):
                with open('/proc/meminfo') as f:
                    for line in f:
                        if line.startswith('MemAvailable:'):
                            return int(line.split()[1]) * 1024
            return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_AVPHYS_PAGES')
    except (ValueError, OSError, RuntimeError, AttributeError):
        pass
    return None


def check_fits(n_bytes, device, what):
    """Refuse work that needs more memory than `device` has free, by arithmetic, before any tensor."""
    free = memory_free(device)
    if free is not None and n_bytes > free:
        raise BadInput(f"{what} needs {gigabytes(n_bytes)}, more than the {gigabytes(free)} free on {device} here")


def load_target(path, device='cpu'):
    """A target GPT from a checkpoint of ours or nanoGPT's."""
    device = pick_device(device, 'device')
    return target_from(load_checkpoint(path), path, device)


def target_from(ckpt, path, device='cpu'):
    """The target GPT of a loaded checkpoint dict (path: for messages); non-finite weights refused.
    Its model_args are checked against the weights the file holds (their element counts) before any
    tensor is made: a crafted config (a million layers over a small file) is refused, not allocated."""
    if 'model' not in ckpt or 'model_args' not in ckpt:
        raise BadInput(f"checkpoint {path} has no 'model'/'model_args': not a GPT checkpoint")
    config = check_model_args(ckpt['model_args'], f"checkpoint {path}")
    weights = {n.removeprefix('_orig_mod.'): t for n, t in ckpt['model'].items()}
    held = sum(t.numel() for n, t in weights.items() if not n.endswith(('.attn.bias', '.attn.masked_bias')))
    want = weight_count(config)
    if want != held:
        sizes = ', '.join(f"{n}={getattr(config, n)}"
                          for n in ('n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size'))
        raise BadInput(f"checkpoint {path}: its model_args ({sizes}) do not fit its weights: they make {want:,} "
                       f"({gigabytes(4 * want)} in float32), the file holds {held:,} ({gigabytes(4 * held)})")
    check_fits(4 * want, device, f"the model of {path}")
    try:
        model = GPT.from_checkpoint(dict(ckpt, model_args=dataclasses.asdict(config)))
    except Exception as e:  # any malformed content: shapes, types, impossible sizes
        raise BadInput(f"checkpoint {path}: weights do not fit its config ({first_line(e, type(e).__name__)})")
    check_finite(model, f"checkpoint {path}")
    return model.to(device).eval()


# ----------------------------------------------------------------------------- vocabularies

class Vocab:
    """Text <-> token ids. kind 'bytes' | 'char' (itos: the symbol of every id) | 'gpt2'."""

    def __init__(self, kind='bytes', itos=None):
        self.kind, self.itos = kind, itos
        if kind == 'char':
            self.stoi = {s: i for i, s in enumerate(itos)}

    @functools.cached_property
    def bpe(self):
        try:
            import tiktoken  # optional: only the text of GPT-2-vocabulary models needs it
        except ImportError:
            raise BadInput("a GPT-2-vocabulary model needs tiktoken for its text: pip install tiktoken")
        return tiktoken.get_encoding('gpt2')

    @property
    def size(self):
        return {'bytes': 256, 'char': len(self.itos or ()), 'gpt2': 50257}[self.kind]

    def __eq__(self, other):
        return isinstance(other, Vocab) and self.state() == other.state()

    def __repr__(self):
        return f"{self.kind} vocabulary ({self.size} symbols)"

    def encode(self, text, what='the prompt'):
        """Ids of `text`; a symbol the vocabulary lacks is a one-line error naming it."""
        if not isinstance(text, str):
            raise BadInput(f"{what} is {describe(text)}; want text (a str)")
        if self.kind == 'bytes':   # surrogateescape: a non-UTF-8 command line gives its own bytes
            return list(text.encode('utf-8', 'surrogateescape'))
        if self.kind == 'gpt2':
            return self.bpe.encode(text, allowed_special={'<|endoftext|>'})
        missing = sorted({c for c in text if c not in self.stoi})
        if missing:
            raise BadInput(f"{what} has {len(missing)} character(s) outside the model's {self.size}-symbol "
                           f"vocabulary: {''.join(missing)[:40]!r}")
        return [self.stoi[c] for c in text]

    def decode(self, ids):
        """The text of a sequence of token ids (a list, or a 1-D tensor); an id the vocabulary lacks
        (past its end, or negative) has no text of its own: bytes and GPT-2 leave it out, a char
        vocabulary shows it as U+FFFD."""
        try:
            ids = [int(i) for i in ids]
        except (TypeError, ValueError, RuntimeError):
            raise BadInput(f"ids {describe(ids)}: want a sequence of token ids (a list of ints or a 1-D tensor)")
        if self.kind == 'bytes':
            return bytes(i for i in ids if 0 <= i < 256).decode('utf-8', errors='replace')
        if self.kind == 'gpt2':   # ids of nanoGPT's padding (50257..50303) have no text
            return self.bpe.decode([i for i in ids if 0 <= i < 50257])
        return ''.join(self.itos[i] if 0 <= i < len(self.itos) else '\ufffd' for i in ids)

    def state(self):
        """Plain values, for a checkpoint."""
        return dict(kind=self.kind, itos=self.itos)

    @classmethod
    def from_state(cls, state, where):
        try:
            kind, itos = state['kind'], state.get('itos')
            assert kind in ('bytes', 'char', 'gpt2')
            assert kind != 'char' or (isinstance(itos, list) and all(isinstance(s, str) for s in itos))
        except (AssertionError, KeyError, TypeError, AttributeError):
            raise BadInput(f"{where}: malformed vocabulary record")
        return cls(kind, itos)


class _NoCode(pickle.Unpickler):
    """Unpickles plain data only: any class or function the file names is refused before it is
    looked up, so nothing in the file can run."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def read_meta(path):
    """A nanoGPT meta.pkl ({'vocab_size', 'stoi', 'itos'}) as a char Vocab, read without executing
    anything: plain data only (a pickle naming any class or function is refused)."""
    path = check_path(path, 'meta')
    try:
        with open(path, 'rb') as f:
            meta = _NoCode(f).load()
    except OSError as e:
        raise BadInput(f"meta file {path}: {e.strerror or e}")
    except Exception as e:
        raise BadInput(f"meta file {path} refused: not a plain nanoGPT meta.pkl ({e})")
    itos = meta.get('itos') if isinstance(meta, dict) else None
    ok = (isinstance(itos, dict) and set(itos) == set(range(len(itos)))    # keys of any type: no sort
          and all(isinstance(s, str) for s in itos.values()))
    if not ok:
        raise BadInput(f"meta file {path}: no 'itos' mapping ids 0..n-1 to strings")
    return Vocab('char', [itos[i] for i in range(len(itos))])


def vocab_for(ckpt, path, vocab_size, meta=None, data=None):
    """The vocabulary of a target checkpoint: `meta` if given, --meta's or the meta.pkl of the
    --data folder `data` (refused if it is not the one the checkpoint records); the one this
    project recorded in it;
    nanoGPT's meta.pkl where its sample.py looks (data/<config dataset>/meta.pkl) or beside the
    checkpoint; else by size: 256 is bytes, 50257 / 50304 is GPT-2."""
    recorded = ckpt.get('vocab') and Vocab.from_state(ckpt['vocab'], path)
    if meta:
        vocab = read_meta(meta)
        if recorded and vocab != recorded:   # a checkpoint of ours says which vocabulary it was trained in
            if data is not None:
                raise BadInput(f"--data {data}: its meta.pkl holds a {vocab}, not the {recorded} {path} records; "
                               f"train the drafters on text in the target's vocabulary")
            raise BadInput(f"--meta {meta}: its {vocab} is not the {recorded} {path} records; leave --meta out")
    elif recorded:
        vocab = recorded
    else:
        dataset = (ckpt.get('config') or {}).get('dataset')
        found = [p for p in ([os.path.join('data', str(dataset), 'meta.pkl')] if dataset else [])
                 + [os.path.join(os.path.dirname(path), 'meta.pkl')] if os.path.isfile(p)]
        if found:
            vocab = read_meta(found[0])
        elif vocab_size == 256:
            vocab = Vocab('bytes')
        elif vocab_size in GPT2_SIZES:
            vocab = Vocab('gpt2')
        else:
            raise BadInput(f"{path}: no vocabulary found for its {vocab_size}-token model "
                           f"(no meta.pkl in data/{dataset or '<dataset>'}/ or beside it); give --meta PATH")
    if vocab.size > vocab_size:
        raise BadInput(f"{path}: its model has {vocab_size} token ids, fewer than the {vocab}")
    return vocab


def load_vocab(path, meta=None):
    """The vocabulary of the target checkpoint at `path`, found as `vocab_for` finds it."""
    ckpt = load_checkpoint(path)
    return vocab_for(ckpt, path, config_of(ckpt, path).vocab_size, meta)


# ----------------------------------------------------------------------------- corpora

def regular_files(root):
    """Every regular file under root, sorted; FIFOs, sockets, devices and broken links are skipped
    (reading a FIFO would wait forever) and counted. One that cannot be read stops the load in one
    line (read_bytes)."""
    files, skipped = [], 0
    for d, dirs, names in os.walk(root):
        dirs.sort()
        for n in names:
            p = os.path.join(d, n)
            try:
                ok = stat.S_ISREG(os.stat(p).st_mode)
            except OSError:   # a broken link
                ok = False
            files += [p] if ok else []
            skipped += not ok
    return sorted(files), skipped


def corpus_files(path=None):
    """The default corpus: the interpreter's standard library .py files, sorted, without
    site-packages and test folders. With a path: that text file, or every file under that folder."""
    if path is None:
        root = sysconfig.get_paths()['stdlib']
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in ('site-packages', 'dist-packages', 'test', 'tests',
                                                            'idle_test', '__pycache__'))
            files += [os.path.join(d, n) for n in names if n.endswith('.py')]
        return sorted(files), 0
    if os.path.isdir(path):
        return regular_files(path)
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        raise BadInput(f"--data {path}: not a regular file or folder")
    if os.path.isfile(path):
        return [path], 0
    raise BadInput(f"--data {path}: no such file or folder")


def read_bytes(f, flag='--data'):
    try:
        with open(f, 'rb') as fh:
            return fh.read()
    except OSError as e:
        raise BadInput(f"{flag}: cannot read {f} ({e.strerror or e})")


class Dataset:
    """train, val: 1-D arrays of token ids; vocab: the Vocab they are in, or None (a nanoGPT
    dataset without meta.pkl: GPT-2 ids, as nanoGPT assumes); meta: the meta.pkl it was read from."""

    def __init__(self, train, val, vocab, source, meta=None):
        self.train, self.val, self.vocab, self.source, self.meta = train, val, vocab, source, meta

    def check(self, vocab_size, vocab, flag='--data'):
        """Refuse ids the model does not have, or data in another vocabulary than the model's."""
        if self.vocab is not None and vocab is not None and self.vocab != vocab:
            raise BadInput(f"{flag} {self.source}: its {self.vocab} is not the model's {vocab}")
        top = max(int(self.train.max()), int(self.val.max()))
        if top >= vocab_size:
            raise BadInput(f"{flag} {self.source}: holds token id {top}, but the model has only {vocab_size} "
                           f"ids (0..{vocab_size - 1})")
        return self


def nanogpt_bins(data, flag='--data'):
    """The train.bin and val.bin of a nanoGPT dataset folder, checked (each there, a regular readable
    file, a whole number of uint16 ids, enough of them), or None where `data` is not such a folder."""
    bins = {split: os.path.join(data, f'{split}.bin') for split in ('train', 'val')} if data else {}
    there = [split for split, p in bins.items() if os.path.lexists(p)]
    if not there:
        return None
    for split, p in bins.items():
        if split not in there:
            raise BadInput(f"{flag} {data}: a nanoGPT dataset folder holds train.bin and val.bin; {split}.bin is "
                           f"missing")
        if not os.path.isfile(p):
            raise BadInput(f"{flag} {data}: {split}.bin is not a regular file")
        if not os.access(p, os.R_OK):   # a one-line error, not a traceback from numpy
            raise BadInput(f"{flag} {data}: cannot read {split}.bin")
        size = os.path.getsize(p)
        if size % 2:
            raise BadInput(f"{flag} {data}: {split}.bin has {size} bytes, not a whole number of token ids (uint16, "
                           f"2 bytes each): truncated or not nanoGPT's")
        if size < 2 * (PROMPT_LEN + 2):
            raise BadInput(f"{flag} {data}: {split}.bin holds too few tokens")
    return bins


def load_dataset(data, cache_dir, write_cache=True, flag='--data'):
    """The corpus as a Dataset. A nanoGPT dataset folder (train.bin, val.bin) is memory-mapped as
    it is. Text is read as bytes and cached under cache_dir (write_cache=False: a cache there is
    read, none is written); held-out split by file: every 20th file, or with fewer than 20 the last
    one (a single file: its last 10%), and no held-out file in the training text."""
    bins = nanogpt_bins(data, flag)
    if bins:
        arrays = [np.memmap(bins[split], dtype=np.uint16, mode='r') for split in ('train', 'val')]
        meta = os.path.join(data, 'meta.pkl')
        if not os.path.isfile(meta):
            return Dataset(*arrays, None, data)
        return Dataset(*arrays, read_meta(meta), data, meta)
    files, skipped = corpus_files(data)
    # the cache key names the files and their sizes and dates: edit the corpus, get a new cache
    h = hashlib.sha1(b'split 2\n')   # how the text is split: a cache of an earlier rule is not read
    for f in files:
        st = os.stat(f)
        h.update(os.fsencode(os.path.abspath(f)) + f':{st.st_size}:{st.st_mtime_ns}\n'.encode())   # any file name
    key = ('stdlib' if data is None else 'data') + '-' + h.hexdigest()[:12]
    paths = [os.path.join(cache_dir, f'{key}_{s}.bin') for s in ('train', 'val')]
    if all(os.path.exists(p) for p in paths):
        return Dataset(*(np.fromfile(p, dtype=np.uint8) for p in paths), Vocab('bytes'), data or 'stdlib')
    texts = [b for b in map(read_bytes, files) if b and b'\0' not in b[:4096]]   # skip binaries
    if skipped:
        print(f"note: {flag} {data}: skipped {skipped} entries that are not regular files (FIFOs, sockets, "
              f"broken links)")
    if not texts or sum(map(len, texts)) < 1024:
        raise BadInput(f"{flag} {data}: holds no text (need at least 1 KiB of text files)")
    if len(texts) == 1:
        cut = int(len(texts[0]) * 0.9)
        train, val = texts[0][:cut], texts[0][cut:]
    else:
        held = {i for i in range(len(texts)) if i % 20 == 19} or {len(texts) - 1}
        train = b''.join(t for i, t in enumerate(texts) if i not in held)
        val = b''.join(t for i, t in enumerate(texts) if i in held)
    arrays = (np.frombuffer(train, dtype=np.uint8), np.frombuffer(val, dtype=np.uint8))
    if write_cache:
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            raise BadInput(f"cannot write the corpus cache in {cache_dir} ({e.strerror or e})")
        for arr, p in zip(arrays, paths):
            write_atomically(p, arr.tofile, 'corpus cache')
    return Dataset(*arrays, Vocab('bytes'), data or 'stdlib')


def check_out_dir(path, flag='--out-dir'):
    """The output folder exists and can be written to, before any work."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"{flag} {path}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f'.write-test-{os.getpid()}')
        with open(probe, 'w'):
            pass
        os.remove(probe)
    except OSError as e:
        raise BadInput(f"{flag} {path}: cannot write there ({e.strerror or e})")


def windows(data, n, length, gen):
    """n random windows (n, length) of a 1-D id array, as a LongTensor."""
    ix = torch.randint(len(data) - length, (n,), generator=gen).numpy()
    return torch.from_numpy(np.stack([data[i:i + length] for i in ix]).astype(np.int64))


def heldout_prompts(val, n, length, newline=ord('\n'), seed=1234):
    """n held-out prompts that start at a line start (`newline`: the id of '\\n', None if the
    vocabulary has none): the same ones for every comparison."""
    starts = np.flatnonzero(np.asarray(val[:-length - 1]) == newline) + 1 if newline is not None else []
    if len(starts) < n:  # text with few lines: any position will do
        starts = np.arange(len(val) - length)
    rng = np.random.default_rng(seed)
    ix = rng.choice(starts, size=n, replace=False)
    return torch.from_numpy(np.stack([val[i:i + length] for i in ix]).astype(np.int64))


def heldout_prompts_of(out_dir='out', n=DEMO_PROMPTS, device='cpu'):
    """The held-out prompts train.py's closing demos decode, (n, PROMPT_LEN) token ids, from its
    output folder (or its target's checkpoint file): the data and vocabulary its target,
    out_dir/ckpt.pt, records (a nanoGPT checkpoint: data/<its dataset>, where nanoGPT keeps it). Reading writes nothing: the corpus
    cache train.py left in out_dir/data is read when it is there, else the text is read again and
    not cached."""
    out_dir = check_path(out_dir, 'out_dir')
    if not is_whole(n, 1):
        raise BadInput(f"n={n!r}: how many prompts, a whole number >= 1")
    path = os.path.join(out_dir, 'ckpt.pt')
    if os.path.isfile(out_dir):   # the target's checkpoint itself: its folder is the run's
        path, out_dir = out_dir, os.path.dirname(out_dir) or '.'
    ckpt = load_checkpoint(path)
    vocab = vocab_for(ckpt, path, config_of(ckpt, path).vocab_size)
    config = ckpt.get('config') or {}
    data = config.get('data')
    if 'data' not in config and config.get('dataset'):    # nanoGPT's train.py
        data = os.path.join('data', config['dataset'])
    if data is not None and not os.path.exists(data):
        raise BadInput(f"{path} was trained on {data}, which is not there (from {os.getcwd()})")
    val = load_dataset(data, os.path.join(out_dir, 'data'), write_cache=False, flag=f"the data of {path},").val
    if len(val) < PROMPT_LEN + n + 1:
        raise BadInput(f"n={n}: the held-out text of {path} is too short for that many prompts")
    return heldout_prompts(val, n, PROMPT_LEN, newline_id(vocab)).to(pick_device(device, 'device'))


def newline_id(vocab):
    """The id of '\\n' in `vocab` (GPT-2's when None: a nanoGPT dataset without meta.pkl), or None."""
    if vocab is None or vocab.kind == 'gpt2':
        return 198
    return 10 if vocab.kind == 'bytes' else vocab.stoi.get('\n')

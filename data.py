"""
What comes in from outside the program, and how bad input is refused: command-line numbers,
checkpoint files, vocabularies, corpora and held-out prompts, for generate.py, train.py and bench.py
alike. Every user error is a `BadInput`, which the scripts print as one `error:` line.

Checkpoints (`load_checkpoint`, `save_checkpoint`, `load_target`): written atomically, read with
`weights_only=True` (tensors and plain values only: nothing in a file runs), finite weights only.

Vocabularies (`Vocab`):
  bytes   UTF-8 bytes, 256 ids: this project's own models (the default)
  char    a nanoGPT character vocabulary, from its meta.pkl (stoi / itos); read without running code
  gpt2    GPT-2 BPE through tiktoken (optional; 50257 / 50304-vocabulary checkpoints)
A target's vocabulary is found as nanoGPT's sample.py finds it (`vocab_for`), recorded in every
checkpoint this project writes, and checked wherever text or a dataset becomes ids.

Corpora (`load_dataset`): a text file or folder of text files (bytes; by default the Python
standard library), or a nanoGPT dataset folder: train.bin / val.bin (uint16 ids) and optionally
meta.pkl.
"""
import argparse
import functools
import hashlib
import math
import os
import pickle
import signal
import stat
import sys
import sysconfig
import time
from contextlib import ExitStack, contextmanager

import numpy as np
import torch

from model import GPT

PROMPT_LEN = 32       # corpus prompt in front of each generated training sequence
GPT2_SIZES = (50257, 50304)   # GPT-2's vocabulary, and nanoGPT's padded one


# ----------------------------------------------------------------------------- errors and flags

class BadInput(ValueError):
    """A user error (bad argument, missing or mismatched file): the scripts print its message as
    one line and exit non-zero instead of showing a traceback."""


def first_line(e, default='', limit=200):
    """An exception's message cut to its first line (and `limit` characters), to quote inside a
    one-line error; `default` when it has no message."""
    return (str(e).strip().splitlines() or [default])[0][:limit]


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (unknown flag, not a number, ...) are one `error:` line too."""

    def error(self, message):
        raise BadInput(message)


def check_number(flag, value, lo=None, hi=None, open_lo=False, open_hi=False, note=''):
    """A flag's number is finite and within its bounds (open_lo / open_hi: the bound itself is
    excluded): else a one-line BadInput naming the flag and what is allowed."""
    ok = (isinstance(value, int) or math.isfinite(value)) and (lo is None or value > lo or (value == lo and not open_lo)) \
        and (hi is None or value < hi or (value == hi and not open_hi))
    if not ok:
        allowed = ' and '.join([f"{'>' if open_lo else '>='} {lo}"] * (lo is not None)
                               + [f"{'<' if open_hi else '<='} {hi}"] * (hi is not None)) or 'finite'
        raise BadInput(f"{flag} {value}: must be {allowed}" + (f" ({note})" if note else ''))
    return value


# A model this small decodes one token in operations too small to split between threads
# (bench/threads/RESULTS.md): one thread is as fast on a quiet machine, and many times faster beside
# a busy one.
SMALL_MODEL = 20_000_000   # parameters


def intra_op_threads(threads=None, small=False):
    """Set the threads torch's CPU kernels use and return how many: `threads` when given (--threads),
    else one for small work (decoding a model under SMALL_MODEL parameters), else every core not
    already busy (busy_cores), at least one. Measured on 2 cores (bench/threads/RESULTS.md): beside
    busy processes two threads were up to 2.5x slower than one for a training step and up to 110x
    for a decode, each thread waiting for the other at every operation; on a quiet machine two were
    1.5x faster for training and no faster for decoding."""
    if threads is None:
        cores = os.cpu_count() or 1
        threads = 1 if small else max(1, min(cores, cores - round(busy_cores(cores))))
    torch.set_num_threads(threads)
    return threads


def busy_cores(cores, window=0.2):
    """How many cores other processes keep busy now: the share of CPU time not idle over `window`
    seconds of /proc/stat (Linux; this process sleeps meanwhile), else the 1-minute load average,
    which lags by about a minute."""
    def snap():
        with open('/proc/stat') as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4], time.process_time(), time.perf_counter()
    try:
        (total0, idle0, own0, t0), _, (total1, idle1, own1, t1) = snap(), time.sleep(window), snap()
        # less this process's own: torch's worker threads spin for a while after parallel work
        own = (own1 - own0) / (t1 - t0)
        return max(0.0, cores * (1 - (idle1 - idle0) / max(1, total1 - total0)) - own)
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] if hasattr(os, 'getloadavg') else 0.0


def run_script(main, interrupted='interrupted'):
    """Run a script's main(): a BadInput ends it with one `error: ...` line and exit code 2; Ctrl-C
    with one line (the KeyboardInterrupt's own message, else `interrupted`) and exit code 130."""
    if signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.SIG_DFL):   # the script's start-up handler
        signal.signal(signal.SIGINT, signal.default_int_handler)                  # hands over to the one below
    try:
        main()
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except NotImplementedError as e:   # a handout (python -m exercises handout): an exercise not written yet
        print(f"not written yet: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:   # a script may raise its own, saying what was saved
        print(f"\n{str(e) or interrupted}", file=sys.stderr)
        sys.exit(130)


# ----------------------------------------------------------------------------- device and precision

def pick_device(name=None):
    """The device to run on: `name` if this machine has it (a one-line error if not), else the best
    available."""
    if name is None:
        if torch.cuda.is_available():
            return 'cuda'
        mps = getattr(torch.backends, 'mps', None)
        return 'mps' if mps is not None and mps.is_available() else 'cpu'
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise BadInput(f"--device {name!r}: not a device; use cpu, cuda, cuda:N or mps")
    if dev.type == 'cuda' and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
        raise BadInput(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type == 'mps' and not (getattr(torch.backends, 'mps', None) and torch.backends.mps.is_available()):
        raise BadInput(f"--device {name}: MPS is not available on this machine")
    if dev.type not in ('cpu', 'cuda', 'mps'):
        raise BadInput(f"--device {name}: use cpu, cuda, cuda:N or mps")
    return name


# name -> what it computes in: float32, or bfloat16 by autocast (the weights, the optimizer and the
# sampling arithmetic stay float32; 'auto' is resolved by pick_dtype)
DTYPES = ('auto', 'float32', 'bfloat16')


def pick_dtype(name, device, training=False, flag='--dtype'):
    """'float32' or 'bfloat16' for `name` in DTYPES on `device` (a one-line error where the device
    cannot). auto: bfloat16 for training on a CUDA device that supports it; float32 elsewhere, and
    for decoding always (its greedy output is compared token for token with plain decoding's)."""
    kind = torch.device(device).type
    bf16_ok = kind == 'cpu' or (kind == 'cuda' and torch.cuda.is_bf16_supported())
    if name == 'auto':
        return 'bfloat16' if training and kind == 'cuda' and bf16_ok else 'float32'
    if name not in DTYPES:
        raise BadInput(f"{flag} {name!r}: choose one of {', '.join(DTYPES)}")
    if name == 'bfloat16' and not bf16_ok:
        raise BadInput(f"{flag} bfloat16: not supported on {device} here; use float32")
    return name


class Precision:
    """The precision a piece of work runs at, stated once and entered where it runs:
    `dtype` 'float32', or 'bfloat16' by autocast on the device; `tf32`: float32 matmuls on CUDA
    may round through TF32. Entering sets both and leaving restores what was there, so the TF32
    of a training step never leaks into decoding in the same process (bench.py trains in-process),
    where a k-token verification and a one-token step would otherwise round differently."""

    def __init__(self, dtype='float32', device='cpu', tf32=False):
        self.dtype, self.device_type, self.tf32 = dtype, torch.device(device).type, tf32
        self._stack = []

    def __str__(self):
        return self.dtype + (' autocast' if self.dtype != 'float32' else '') + (' + TF32' if self.tf32 else '')

    def autocast(self):
        # float32 switches autocast off: decoding's float32 inside a bf16 step stays float32
        return torch.autocast(self.device_type, dtype=getattr(torch, self.dtype), enabled=self.dtype != 'float32')

    @contextmanager
    def matmuls(self):
        """Only the float32 matmul precision (TF32 or not; CUDA only: CPU kernels are left alone)."""
        before = torch.get_float32_matmul_precision()
        if self.device_type == 'cuda':
            torch.set_float32_matmul_precision('high' if self.tf32 else 'highest')
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)

    def __enter__(self):
        stack = ExitStack()
        stack.enter_context(self.matmuls())
        stack.enter_context(self.autocast())
        self._stack.append(stack)
        return self

    def __exit__(self, *exc):
        return self._stack.pop().__exit__(*exc)


def decoding_precision(name, device, tf32=False):
    """generate.py's and bench.py's --dtype and --tf32 as a Precision (one-line errors for what
    means nothing or what the device cannot do)."""
    dtype = pick_dtype(name, device)
    if tf32 and (torch.device(device).type != 'cuda' or dtype != 'float32'):
        raise BadInput(f"--tf32 means nothing here: it applies to float32 on a CUDA device (this run: {dtype} "
                       f"on {device})")
    return Precision(dtype, device, tf32)


# ----------------------------------------------------------------------------- checkpoints

def check_finite(module, what):
    """Refuse weights with a NaN or an inf: they would decode garbage or poison a checkpoint."""
    bad = [n for n, t in module.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise BadInput(f"{what}: non-finite weights in {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else ''))


def save_checkpoint(obj, path):
    """Write atomically: a temporary file beside the target, then a rename. An interrupted write
    leaves the previous checkpoint intact."""
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


# numpy scalars, as a checkpoint may hold them (a learning rate computed with numpy, a loss): data
# whose unpickling runs nothing but numpy's own constructors, so weights_only loading allows them
NUMPY_SCALARS = [getattr(np, '_core', np.core).multiarray.scalar, np.dtype] + [
    type(np.dtype(t)) for t in (np.float64, np.float32, np.float16, np.int64, np.int32, np.bool_)]


def load_checkpoint(path, kind=None):
    """torch.load with one-line errors for a missing, corrupt or wrong-kind file. Only tensors and
    plain Python values (and numpy scalars) load (weights_only=True): a file that needs more is
    refused, and nothing in it runs."""
    if not os.path.isfile(path):
        raise BadInput(f"checkpoint not found: {path}")
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
    have = ckpt.get('kind', 'target')
    if kind is not None and have != kind:
        raise BadInput(f"checkpoint {path} holds a {have!r}, expected a {kind!r}")
    return ckpt


def load_target(path, device='cpu'):
    """A target GPT from a checkpoint of ours or nanoGPT's."""
    return target_from(load_checkpoint(path), path, device)


def target_from(ckpt, path, device='cpu'):
    """The target GPT of a loaded checkpoint dict (path: for messages); non-finite weights refused."""
    if 'model' not in ckpt or 'model_args' not in ckpt:
        raise BadInput(f"checkpoint {path} has no 'model'/'model_args': not a GPT checkpoint")
    try:
        model = GPT.from_checkpoint(ckpt)
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
        ids = [int(i) for i in ids]
        if self.kind == 'bytes':
            return bytes(i for i in ids if i < 256).decode('utf-8', errors='replace')
        if self.kind == 'gpt2':   # ids of nanoGPT's padding (50257..50303) have no text
            return self.bpe.decode([i for i in ids if i < 50257])
        return ''.join(self.itos[i] if i < len(self.itos) else '\ufffd' for i in ids)

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
    anything: only dicts, strings and ints are accepted."""
    try:
        with open(path, 'rb') as f:
            meta = _NoCode(f).load()
    except OSError as e:
        raise BadInput(f"meta file {path}: {e.strerror or e}")
    except Exception as e:
        raise BadInput(f"meta file {path} refused: not a plain nanoGPT meta.pkl ({e})")
    itos = meta.get('itos') if isinstance(meta, dict) else None
    ok = (isinstance(itos, dict) and sorted(itos) == list(range(len(itos)))
          and all(isinstance(s, str) for s in itos.values()))
    if not ok:
        raise BadInput(f"meta file {path}: no 'itos' mapping ids 0..n-1 to strings")
    return Vocab('char', [itos[i] for i in range(len(itos))])


def vocab_for(ckpt, path, vocab_size, meta=None):
    """The vocabulary of a target checkpoint: --meta if given; the one this project recorded in it;
    nanoGPT's meta.pkl where its sample.py looks (data/<config dataset>/meta.pkl) or beside the
    checkpoint; else by size: 256 is bytes, 50257 / 50304 is GPT-2."""
    if meta:
        vocab = read_meta(meta)
    elif ckpt.get('vocab') is not None:
        vocab = Vocab.from_state(ckpt['vocab'], path)
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
    return vocab_for(ckpt, path, target_from(ckpt, path).config.vocab_size, meta)


# ----------------------------------------------------------------------------- corpora

def regular_files(root):
    """Every regular, readable file under root, sorted; FIFOs, sockets, devices and broken links
    are skipped (reading a FIFO would wait forever) and counted."""
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


def load_dataset(data, cache_dir):
    """The corpus as a Dataset. A nanoGPT dataset folder (train.bin, val.bin) is memory-mapped as
    it is. Text is read as bytes and cached under cache_dir; held-out split by file: every 20th
    file (a single file: its last 10%)."""
    if data and os.path.isfile(os.path.join(data, 'train.bin')) and os.path.isfile(os.path.join(data, 'val.bin')):
        arrays = []
        for split in ('train', 'val'):
            p = os.path.join(data, f'{split}.bin')
            if not os.access(p, os.R_OK):   # a one-line error, not a traceback from numpy
                raise BadInput(f"--data {data}: cannot read {split}.bin")
            if os.path.getsize(p) < 2 * (PROMPT_LEN + 2):
                raise BadInput(f"--data {data}: {split}.bin holds too few tokens")
            arrays.append(np.memmap(p, dtype=np.uint16, mode='r'))
        meta = os.path.join(data, 'meta.pkl')
        if not os.path.isfile(meta):
            return Dataset(*arrays, None, data)
        return Dataset(*arrays, read_meta(meta), data, meta)
    files, skipped = corpus_files(data)
    # the cache key names the files and their sizes and dates: edit the corpus, get a new cache
    h = hashlib.sha1()
    for f in files:
        st = os.stat(f)
        h.update(f'{os.path.abspath(f)}:{st.st_size}:{st.st_mtime_ns}\n'.encode())
    key = ('stdlib' if data is None else 'data') + '-' + h.hexdigest()[:12]
    paths = [os.path.join(cache_dir, f'{key}_{s}.bin') for s in ('train', 'val')]
    if all(os.path.exists(p) for p in paths):
        return Dataset(*(np.fromfile(p, dtype=np.uint8) for p in paths), Vocab('bytes'), data or 'stdlib')
    texts = [b for b in map(read_bytes, files) if b and b'\0' not in b[:4096]]   # skip binaries
    if skipped:
        print(f"note: --data {data}: skipped {skipped} entries that are not regular files (FIFOs, sockets, broken links)")
    if not texts or sum(map(len, texts)) < 1024:
        raise BadInput(f"--data {data}: holds no text (need at least 1 KiB of text files)")
    if len(texts) == 1:
        cut = int(len(texts[0]) * 0.9)
        train, val = texts[0][:cut], texts[0][cut:]
    else:
        train = b''.join(t for i, t in enumerate(texts) if i % 20 != 19)
        val = b''.join(t for i, t in enumerate(texts) if i % 20 == 19) or texts[-1]
    arrays = (np.frombuffer(train, dtype=np.uint8), np.frombuffer(val, dtype=np.uint8))
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for arr, p in zip(arrays, paths):
            tmp = f'{p}.{os.getpid()}.tmp'
            arr.tofile(tmp)
            os.replace(tmp, p)
    except OSError as e:
        raise BadInput(f"cannot write the corpus cache in {cache_dir} ({e.strerror or e})")
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


def newline_id(vocab):
    """The id of '\\n' in `vocab` (GPT-2's when None: a nanoGPT dataset without meta.pkl), or None."""
    if vocab is None or vocab.kind == 'gpt2':
        return 198
    return 10 if vocab.kind == 'bytes' else vocab.stoi.get('\n')

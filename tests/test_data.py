"""data.py, and the scripts' thread count (cli.py): vocabularies (bytes, nanoGPT characters, GPT-2 BPE), safe
meta.pkl reading, corpora and nanoGPT datasets; and a nanoGPT user's whole path: a character-level
checkpoint in nanoGPT's format decodes, trains BPD heads and DBlast drafters on its own dataset, and
stays exact."""
import importlib.util
import os
import pickle
import re
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import Proc, corpus_text, run_main
import cli
import data
from cli import BadInput, busy_cores, check_replaceable, intra_op_threads
from data import (DEMO_PROMPTS, PROMPT_LEN, Vocab, heldout_prompts, heldout_prompts_of, load_checkpoint, load_dataset,
                  load_target, load_vocab, read_meta, regular_files, save_checkpoint, vocab_for)
from decode import generate
from drafters import load_drafter
from model import GPT, GPTConfig

pytestmark = pytest.mark.second_process   # balances the two processes (conftest.py)

TEXT = corpus_text(4000) + "Hello, World! 42\n"


def nanogpt_char_dataset(folder, text=TEXT):
    """A dataset folder as nanoGPT's data/shakespeare_char/prepare.py writes it."""
    chars = sorted(set(text))
    stoi, itos = {c: i for i, c in enumerate(chars)}, {i: c for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    os.makedirs(folder, exist_ok=True)
    ids[:n].tofile(os.path.join(folder, 'train.bin'))
    ids[n:].tofile(os.path.join(folder, 'val.bin'))
    with open(os.path.join(folder, 'meta.pkl'), 'wb') as f:
        pickle.dump({'vocab_size': len(chars), 'itos': itos, 'stoi': stoi}, f)
    return chars, ids


def nanogpt_checkpoint(path, vocab_size, dataset, steps=150, ids=None):
    """A small char-level GPT trained on `ids`, saved as nanoGPT's train.py saves it: compiled
    ('_orig_mod.') state dict keys, model_args, config with the dataset's name, optimizer."""
    torch.manual_seed(0)
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, bias=False, vocab_size=vocab_size, dropout=0.0)
    model = GPT(GPTConfig(**args))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    t = torch.from_numpy(ids.astype(np.int64))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ix = torch.randint(len(t) - 65, (16,), generator=g)
        x = torch.stack([t[i:i + 65] for i in ix.tolist()])
        loss = model(x[:, :-1], x[:, 1:])[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(dict(model={'_orig_mod.' + k: v for k, v in model.state_dict().items()}, model_args=args,
                    optimizer=opt.state_dict(), iter_num=steps, best_val_loss=torch.tensor(loss.item()),
                    config=dict(dataset=dataset, out_dir=os.path.dirname(path), batch_size=16)), path)


def run(script, *args, cwd):
    """`python script args` from the folder cwd, as a user in nanoGPT's folder runs it (in-process)."""
    return Proc(*run_main(script, args, cwd))


def one_error_line(proc, *needles):
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert 'Traceback' not in proc.stderr, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith('error:')]
    assert len(errors) == 1, proc.stderr
    for n in needles:
        assert n in errors[0], errors[0]


def printed_text(stdout):
    """The generated text generate.py prints before its '--- ...' statistics."""
    return stdout.rsplit('\n\n--- ', 1)[0]


# ----------------------------------------------------------------------------- threads

@pytest.mark.skipif(not os.path.exists('/proc/stat'), reason="Linux's /proc/stat: elsewhere the load average")
def test_busy_cores_sees_a_process_that_keeps_a_core_busy():
    """The scripts' thread count without --threads (the tests' in_process stands in for this
    reading, conftest.py): a process spinning on one core is read as at least most of a busy core,
    and the threads left for torch are the cores not busy, at least one."""
    spinner = subprocess.Popen([sys.executable, '-c', 'print(flush=True)\nwhile True: pass'], stdout=subprocess.PIPE)
    threads = torch.get_num_threads()
    try:
        spinner.stdout.readline()                      # it is spinning
        busy = busy_cores(os.cpu_count())
        assert 0.7 <= busy <= os.cpu_count(), busy
        assert 1 <= intra_op_threads() == torch.get_num_threads() <= max(1, os.cpu_count() - 1)
        assert intra_op_threads(3) == 3 == torch.get_num_threads() and intra_op_threads(small=True) == 1
    finally:
        spinner.kill()
        spinner.wait()
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- vocabularies

def test_byte_vocabulary_round_trips_any_command_line_text():
    v = Vocab('bytes')
    assert v.decode(v.encode('def f(x): ü')) == 'def f(x): ü'
    raw = b'\xff\xfe ok'.decode('utf-8', 'surrogateescape')   # how Python hands over a non-UTF-8 argv
    assert v.encode(raw) == list(b'\xff\xfe ok')


def test_char_vocabulary_names_the_characters_it_lacks(tmp_path):
    chars, _ = nanogpt_char_dataset(tmp_path / 'ds')
    v = read_meta(tmp_path / 'ds' / 'meta.pkl')
    assert v.kind == 'char' and v.itos == chars and v.size == len(chars)
    assert v.decode(v.encode('def f')) == 'def f'
    with pytest.raises(BadInput, match=r"2 character\(s\) outside the model's .*'@~'"):
        v.encode('def @~')
    # an itos whose keys cannot be sorted together is refused in one line, not a TypeError
    with open(tmp_path / 'mixed.pkl', 'wb') as f:
        pickle.dump(dict(vocab_size=2, stoi={'a': 0, 'b': 'x'}, itos={0: 'a', 'x': 'b'}), f)
    with pytest.raises(BadInput, match="no 'itos' mapping ids 0..n-1 to strings"):
        read_meta(tmp_path / 'mixed.pkl')


def test_a_meta_pkl_of_another_vocabulary_than_the_checkpoints_names_where_it_came_from(tmp_path):
    """A target that records its byte vocabulary, against a char meta.pkl given by --meta, or found in
    the --data folder: refused in one line naming the flag it came from."""
    nanogpt_char_dataset(tmp_path / 'ds')
    meta, ckpt = tmp_path / 'ds' / 'meta.pkl', dict(vocab=Vocab('bytes').state())
    with pytest.raises(BadInput, match=r"^--meta .*meta.pkl: its char vocabulary .* is not the bytes .*leave --meta out"):
        vocab_for(ckpt, 'ckpt.pt', 256, str(meta))
    with pytest.raises(BadInput, match=r"^--data .*ds: its meta.pkl holds a char vocabulary .*, not the bytes"):
        vocab_for(ckpt, 'ckpt.pt', 256, str(meta), str(tmp_path / 'ds'))


def test_a_target_larger_than_the_memory_free_is_refused_before_it_is_made(tmp_path, monkeypatch):
    """target_from sizes the model by arithmetic against the memory free, before any tensor, and an
    error's quoted message is its first line only (cli.first_line: a load_state_dict error runs over
    several)."""
    cfg = GPTConfig(block_size=16, vocab_size=32, n_layer=1, n_head=2, n_embd=16)
    save_checkpoint(dict(model=GPT(cfg).state_dict(), model_args=vars(cfg)), str(tmp_path / 'ckpt.pt'))
    monkeypatch.setattr(data, 'memory_free', lambda device: 1000)
    with pytest.raises(BadInput, match=r"the model of .*ckpt.pt needs .* more than .* free on cpu"):
        load_target(str(tmp_path / 'ckpt.pt'))
    assert cli.first_line(RuntimeError("Error(s) in loading state_dict:\n\tsize mismatch")) == \
        "Error(s) in loading state_dict:"


class Payload:
    """Unpickling this would create the marker file: a meta.pkl must never get that far."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, 'w'))


def test_a_meta_pkl_that_runs_code_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / 'pwned'
    evil = tmp_path / 'meta.pkl'
    evil.write_bytes(pickle.dumps({'vocab_size': 3, 'itos': {0: 'a'}, 'stoi': Payload(str(marker))}))
    with pytest.raises(BadInput, match='refused'):
        read_meta(evil)
    assert not marker.exists()
    bad = tmp_path / 'list.pkl'
    bad.write_bytes(pickle.dumps(['a', 'b']))
    with pytest.raises(BadInput, match="no 'itos'"):
        read_meta(bad)


def test_a_file_torch_never_saved_is_named_so_and_a_pickle_with_code_is_refused(tmp_path):
    """A text file or random bytes given as a checkpoint: 'not a PyTorch checkpoint', not the
    refusal meant for a file that needs more than tensors; a pickle that would run code is still
    refused, unrun; an empty file is unreadable."""
    for name, content in (('notes.md', b'# a README\n'), ('noise.bin', bytes(range(7, 200)))):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(BadInput, match=r"is not a PyTorch checkpoint \(torch.save writes a zip file"):
            load_checkpoint(str(tmp_path / name))
    marker = tmp_path / 'pwned'
    for name, save in (('raw.pkl', lambda p, obj: p.write_bytes(pickle.dumps(obj))),
                       ('saved.pt', lambda p, obj: torch.save(obj, p))):
        save(tmp_path / name, dict(model=Payload(str(marker))))
        with pytest.raises(BadInput, match='refused: it holds more than tensors'):
            load_checkpoint(str(tmp_path / name))
    assert not marker.exists()
    (tmp_path / 'empty.pt').write_bytes(b'')
    with pytest.raises(BadInput, match=r'is unreadable \(EOFError\)'):
        load_checkpoint(str(tmp_path / 'empty.pt'))


def test_vocabulary_found_as_nanogpt_finds_it(tmp_path, monkeypatch):
    """--meta first; then ours, recorded in the checkpoint; then data/<dataset>/meta.pkl from the
    working directory (nanoGPT's sample.py) or beside the checkpoint; then by size."""
    chars, _ = nanogpt_char_dataset(tmp_path / 'data' / 'tiny')
    monkeypatch.chdir(tmp_path)
    ckpt = dict(config=dict(dataset='tiny'))
    assert vocab_for(ckpt, 'out/ckpt.pt', len(chars)).itos == chars
    assert vocab_for(dict(vocab=Vocab('bytes').state()), 'x.pt', 256) == Vocab('bytes')
    assert vocab_for({}, 'x.pt', 256).kind == 'bytes'
    assert vocab_for({}, 'x.pt', 50304).kind == 'gpt2'
    assert vocab_for({}, 'x.pt', len(chars), meta=tmp_path / 'data' / 'tiny' / 'meta.pkl').itos == chars
    os.makedirs(tmp_path / 'beside')
    os.replace(tmp_path / 'data' / 'tiny' / 'meta.pkl', tmp_path / 'beside' / 'meta.pkl')
    assert vocab_for({}, str(tmp_path / 'beside' / 'ckpt.pt'), len(chars)).itos == chars
    with pytest.raises(BadInput, match='give --meta'):
        vocab_for(ckpt, 'out/ckpt.pt', len(chars))
    with pytest.raises(BadInput, match='fewer than'):
        vocab_for({}, str(tmp_path / 'beside' / 'ckpt.pt'), len(chars) - 1)


@pytest.mark.skipif(importlib.util.find_spec('tiktoken') is None, reason='tiktoken (optional) not installed')
def test_gpt2_vocabulary_through_tiktoken():
    v = Vocab('gpt2')
    ids = v.encode('Hello world')
    assert ids == [15496, 995] and v.decode(ids + [50300]) == 'Hello world'   # padding ids have no text


# ----------------------------------------------------------------------------- corpora

def test_nanogpt_dataset_folder_is_read_as_ids_and_checked(tmp_path):
    chars, ids = nanogpt_char_dataset(tmp_path / 'ds')
    ds = load_dataset(str(tmp_path / 'ds'), str(tmp_path / 'cache'))
    assert ds.train.dtype == np.uint16 and np.array_equal(np.concatenate([ds.train, ds.val]), ids)
    assert ds.vocab.itos == chars
    ds.check(len(chars), ds.vocab)
    with pytest.raises(BadInput, match=f'token id {len(chars) - 1}.*only {len(chars) - 1} ids'):
        ds.check(len(chars) - 1, None)
    with pytest.raises(BadInput, match='is not the model'):
        ds.check(256, Vocab('bytes'))


def test_data_folder_takes_regular_files_only(tmp_path):
    """FIFOs (reading one would wait forever), sockets and broken links are skipped and counted."""
    (tmp_path / 'a.txt').write_text(TEXT)
    os.mkfifo(tmp_path / 'fifo')
    os.symlink(tmp_path / 'missing', tmp_path / 'broken')
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / 'sock'))
    try:
        files, skipped = regular_files(str(tmp_path))
        assert files == [str(tmp_path / 'a.txt')] and skipped == 3
        ds = load_dataset(str(tmp_path), str(tmp_path / 'cache'))
        assert bytes(np.concatenate([ds.train, ds.val])) == TEXT.encode()
    finally:
        s.close()


@pytest.mark.parametrize('n_files', [2, 5, 45])
def test_a_folder_is_split_by_file_and_nothing_held_out_is_trained_on(tmp_path, n_files):
    """Every 20th file is held out (with fewer than 20, the last one), and the training text holds
    none of it: a held-out loss and the demos' prompts on text the target never saw."""
    texts = [f"file {i:02d}: ".encode() + bytes([65 + i % 26]) * 600 for i in range(n_files)]
    for i, t in enumerate(texts):
        (tmp_path / f"{i:02d}.txt").write_bytes(t)
    ds = load_dataset(str(tmp_path), str(tmp_path / 'cache'))
    held = [i for i in range(n_files) if i % 20 == 19] or [n_files - 1]
    assert bytes(ds.val) == b''.join(texts[i] for i in held)
    assert bytes(ds.train) == b''.join(t for i, t in enumerate(texts) if i not in held)


def test_a_file_name_that_is_not_utf8_is_read_like_any_other(tmp_path):
    """A corpus folder holding a file whose name is bytes no encoding decodes (Python hands it over
    with surrogates): its text is read, and its name goes into the cache's key as the bytes it is."""
    data = tmp_path / 'corpus'
    data.mkdir()
    with open(os.path.join(os.fsencode(data), b'f\xff.txt'), 'w') as f:
        f.write(TEXT)
    ds = load_dataset(str(data), str(tmp_path / 'cache'))
    assert bytes(np.concatenate([ds.train, ds.val])) == TEXT.encode()
    again = load_dataset(str(data), str(tmp_path / 'cache'), write_cache=False)   # from the cache
    assert bytes(np.concatenate([again.train, again.val])) == TEXT.encode()


# ----------------------------------------------------------------------------- a nanoGPT user's path

@pytest.fixture(scope='module')
def nanogpt_run(tmp_path_factory):
    """cwd/data/tiny_char (train.bin, val.bin, meta.pkl) and cwd/out-tiny_char/ckpt.pt, in
    nanoGPT's formats; then train.py trains BPD heads and DBlast drafters for it on that dataset."""
    cwd = tmp_path_factory.mktemp('nanogpt')
    chars, ids = nanogpt_char_dataset(cwd / 'data' / 'tiny_char')
    nanogpt_checkpoint(str(cwd / 'out-tiny_char' / 'ckpt.pt'), len(chars), 'tiny_char', ids=ids)
    proc = run('train.py', '--stages', 'heads,dblast', '--data', 'data/tiny_char', '--out-dir', 'out-tiny_char',
               '--device', 'cpu', '--k', '4', '--heads-iters', '40', '--distill-samples', '8',
               '--dblast-iters', '20', '--dblast-samples', '8', '--dblast-eval-samples', '2',
               '--batch-size', '8', '--no-demo', cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return cwd, chars


def test_decode_cli_on_a_nanogpt_char_checkpoint_is_greedy_through_itos(nanogpt_run):
    cwd, chars = nanogpt_run
    model = load_target(str(cwd / 'out-tiny_char' / 'ckpt.pt'))
    prompt = 'def f'
    ids = torch.tensor([[chars.index(c) for c in prompt]])
    out, _ = generate(model, ids, 40)
    want = ''.join(chars[i] for i in out[0].tolist())
    proc = run('generate.py', '--ckpt', 'out-tiny_char/ckpt.pt', '--prompt', prompt, '--max-new-tokens', 40,
               '--device', 'cpu', cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert printed_text(proc.stdout) == want
    # drafters record the vocabulary they were trained with
    heads = torch.load(cwd / 'out-tiny_char' / 'heads.pt', weights_only=True)
    assert heads['vocab'] == dict(kind='char', itos=chars)
    # the default length is what fits the 64-token context, with a note
    proc = run('generate.py', '--ckpt', 'out-tiny_char/ckpt.pt', '--prompt', prompt, '--device', 'cpu', cwd=cwd)
    assert proc.returncode == 0 and 'generating 59 tokens' in proc.stderr, proc.stderr
    assert len(printed_text(proc.stdout)) == 64


def test_bpd_heads_trained_on_the_nanogpt_dataset_decode_exactly_greedy(nanogpt_run):
    cwd, _ = nanogpt_run
    plain = run('generate.py', '--ckpt', 'out-tiny_char/ckpt.pt', '--prompt', 'def f(', '--max-new-tokens', 50,
                '--device', 'cpu', cwd=cwd)
    fast = run('generate.py', '--ckpt', 'out-tiny_char/ckpt.pt', '--heads', 'out-tiny_char/heads.pt',
               '--prompt', 'def f(', '--max-new-tokens', 50, '--device', 'cpu', '--no-color', cwd=cwd)
    assert plain.returncode == 0 and fast.returncode == 0, fast.stderr
    assert printed_text(fast.stdout) == printed_text(plain.stdout)
    assert float(re.search(r'mean tau ([\d.]+)', fast.stdout).group(1)) > 1.05   # blocks were accepted
    sampled = run('generate.py', '--ckpt', 'out-tiny_char/ckpt.pt', '--drafter', 'out-tiny_char/dblast_K4.pt',
                  '--prompt', 'def f(', '--temperature', '1.0', '--device', 'cpu', '--no-color', cwd=cwd)
    assert sampled.returncode == 0, sampled.stderr


def test_nanogpt_user_errors_are_one_line(nanogpt_run, tmp_path):
    cwd, chars = nanogpt_run
    # a prompt character the vocabulary lacks
    one_error_line(run('generate.py', '--ckpt', 'out-tiny_char/ckpt.pt', '--prompt', 'def €', '--device', 'cpu',
                       cwd=cwd), "outside the model's", '€')
    # a dataset with ids the model does not have
    ds = tmp_path / 'big'
    ds.mkdir()
    np.array([0, 1, len(chars) + 5] * 200, dtype=np.uint16).tofile(ds / 'train.bin')
    np.array([0, 1, 2] * 200, dtype=np.uint16).tofile(ds / 'val.bin')
    one_error_line(run('train.py', '--stages', 'heads', '--data', str(ds), '--out-dir', 'out-tiny_char',
                       '--device', 'cpu', '--no-demo', cwd=cwd), f'token id {len(chars) + 5}')
    # byte text for a character-level model
    (tmp_path / 'text.txt').write_text(TEXT)
    one_error_line(run('train.py', '--stages', 'heads', '--data', str(tmp_path / 'text.txt'), '--out-dir',
                       'out-tiny_char', '--device', 'cpu', '--no-demo', cwd=cwd), 'bytes vocabulary')
    # a drafter trained with another vocabulary: the same target read through another meta.pkl
    # (the same symbols in another order)
    other = tmp_path / 'meta.pkl'
    itos = dict(enumerate(reversed(chars)))
    other.write_bytes(pickle.dumps(dict(vocab_size=len(chars), itos=itos, stoi={c: i for i, c in itos.items()})))
    one_error_line(run('generate.py', '--ckpt', 'out-tiny_char/ckpt.pt', '--heads', 'out-tiny_char/heads.pt',
                       '--meta', other, '--prompt', 'x', '--device', 'cpu', cwd=cwd), 'different vocabulary')


# ----------------------------------------------------------------------------- held-out prompts of a run

def listing(folder):
    """Every file under folder with its size and modification time: what a read must not change."""
    return {os.path.join(d, n): (os.stat(os.path.join(d, n)).st_size, os.stat(os.path.join(d, n)).st_mtime_ns)
            for d, _, names in os.walk(folder) for n in names}


def test_heldout_prompts_of_an_output_folder_are_train_pys_and_reading_writes_nothing(tmp_path, corpus_file):
    """heldout_prompts_of(out): the prompts train.py's demos decode (its data, as ckpt.pt records it,
    split and drawn as train.py does), (8, PROMPT_LEN); no cache appears in the folder, and a cache
    train.py left there is read, not rewritten."""
    out = tmp_path / 'out'
    out.mkdir()
    cfg = GPTConfig(block_size=64, vocab_size=256, n_layer=1, n_head=2, n_embd=16)
    torch.save(dict(model=GPT(cfg).state_dict(), model_args=vars(cfg), config=dict(data=str(corpus_file)),
                    vocab=Vocab('bytes').state()), out / 'ckpt.pt')
    want = heldout_prompts(load_dataset(str(corpus_file), str(tmp_path / 'elsewhere')).val, DEMO_PROMPTS, PROMPT_LEN,
                           ord('\n'))
    before = listing(tmp_path)
    got = heldout_prompts_of(out)
    assert listing(tmp_path) == before, "reading the prompts wrote into the folder"
    assert got.shape == (DEMO_PROMPTS, PROMPT_LEN) and got.dtype == torch.long and torch.equal(got, want)
    load_dataset(str(corpus_file), str(out / 'data'))          # train.py's cache, as a run leaves it
    before = listing(tmp_path)
    assert torch.equal(heldout_prompts_of(str(out), n=3), heldout_prompts(load_dataset(
        str(corpus_file), str(out / 'data')).val, 3, PROMPT_LEN, ord('\n')))
    assert listing(tmp_path) == before
    with pytest.raises(BadInput, match='checkpoint not found'):
        heldout_prompts_of(tmp_path / 'nowhere')
    with pytest.raises(BadInput, match=r"n=0: how many prompts"):
        heldout_prompts_of(out, n=0)
    torch.save(dict(torch.load(out / 'ckpt.pt', weights_only=True), config=dict(data=str(tmp_path / 'gone.txt'))),
               out / 'ckpt.pt')
    with pytest.raises(BadInput, match=r"gone.txt, which is not there"):
        heldout_prompts_of(out)


def test_heldout_prompts_of_a_nanogpt_folder_come_from_its_dataset(nanogpt_run, monkeypatch):
    """A nanoGPT checkpoint records its dataset's name: the prompts come from data/<name>/val.bin,
    in its meta.pkl's characters, run from nanoGPT's folder; nothing is written."""
    cwd, chars = nanogpt_run
    monkeypatch.chdir(cwd)
    before = listing(cwd)
    got = heldout_prompts_of('out-tiny_char', n=4)
    assert listing(cwd) == before
    val = np.memmap(cwd / 'data' / 'tiny_char' / 'val.bin', dtype=np.uint16, mode='r')
    assert torch.equal(got, heldout_prompts(val, 4, PROMPT_LEN, chars.index('\n')))


# ----------------------------------------------------------------------------- writing files: nothing half-written

def test_a_save_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    """A save that cannot finish (a folder where the file goes; the disk full halfway) is one line
    naming the file and why; the previous checkpoint's bytes are as they were and no *.tmp stays.
    A folder stops root as well as anyone, so this holds run as root or not."""
    path = tmp_path / 'ckpt.pt'
    save_checkpoint(dict(iter_num=1), str(path))
    old = path.read_bytes()
    real = torch.save

    def disk_full(obj, f):
        real(obj, f)
        with open(f, 'r+b') as fh:
            fh.truncate(10)
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(torch, 'save', disk_full)
    with pytest.raises(BadInput, match=r"cannot write the checkpoint .*ckpt.pt \(No space left on device\); nothing "
                                       r"half-written is left, and the previous one is as it was"):
        save_checkpoint(dict(iter_num=2), str(path))
    assert path.read_bytes() == old and sorted(os.listdir(tmp_path)) == ['ckpt.pt']
    monkeypatch.setattr(torch, 'save', real)
    (tmp_path / 'folder.pt').mkdir()
    with pytest.raises(BadInput, match=r"folder.pt \(Is a directory\)"):
        save_checkpoint(dict(iter_num=2), str(tmp_path / 'folder.pt'))
    assert sorted(os.listdir(tmp_path)) == ['ckpt.pt', 'folder.pt'] and not os.listdir(tmp_path / 'folder.pt')
    with pytest.raises(BadInput, match=r"cannot replace the checkpoint .*folder.pt: it is a folder"):
        check_replaceable(str(tmp_path / 'folder.pt'))


def test_a_save_reaches_the_disk_before_it_replaces_the_old_file(tmp_path, monkeypatch):
    """The new checkpoint's bytes are fsync'd before the rename: after a power loss the file at the
    path is the old one or the whole new one, never a renamed file whose data was still in memory."""
    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, 'fsync', lambda fd: events.append(('fsync', os.fstat(fd).st_ino)) or real_fsync(fd))
    monkeypatch.setattr(os, 'replace', lambda a, b: events.append(('replace', os.stat(a).st_ino)) or real_replace(a, b))
    save_checkpoint(dict(iter_num=1), str(tmp_path / 'ckpt.pt'))
    assert [e[0] for e in events] == ['fsync', 'replace'] and events[0][1] == events[1][1], events


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt for the length of the test, however the suite was started (a
    background job inherits SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_during_a_save_finishes_the_save_then_stops(tmp_path, monkeypatch, ctrl_c_raises):
    """Ctrl-C while torch.save is writing: the write finishes and replaces the file, then the
    KeyboardInterrupt comes; a second Ctrl-C stops the write at once, and the old file stays, with
    no temporary file either way."""
    path = tmp_path / 'ckpt.pt'
    save_checkpoint(dict(iter_num=1), str(path))
    real = torch.save

    def interrupted(times):
        def save(obj, f):   # half a file written, then Ctrl-C (`times` presses), then the rest
            real(obj, f)
            with open(f, 'r+b') as fh:
                fh.truncate(os.path.getsize(f) // 2)
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)   # as Ctrl-C: the handler runs between bytecodes
            real(obj, f)
        return save
    monkeypatch.setattr(torch, 'save', interrupted(1))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(dict(iter_num=2), str(path))
    assert torch.load(path, weights_only=True) == dict(iter_num=2) and os.listdir(tmp_path) == ['ckpt.pt']
    monkeypatch.setattr(torch, 'save', interrupted(2))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(dict(iter_num=3), str(path))
    assert torch.load(path, weights_only=True) == dict(iter_num=2) and os.listdir(tmp_path) == ['ckpt.pt']
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler     # the handler is given back


def test_the_functions_the_readme_calls_refuse_bad_arguments_in_one_line(tmp_path):
    """load_target, load_vocab, load_drafter and a Vocab's encode and decode, given what a Python
    caller may get wrong: one BadInput naming the argument and what is allowed, nothing from
    inside torch or os."""
    model = GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=16))
    path = tmp_path / 'ckpt.pt'
    save_checkpoint(dict(model=model.state_dict(), model_args=vars(model.config)), str(path))
    cases = [(lambda: load_target(3), r"checkpoint int 3: give a file name"),
             (lambda: load_target(path, device='cpu:1'), r"device='cpu:1': the CPU is one device"),
             (lambda: load_target(path, device='tpu'), r"device='tpu': not a device"),
             (lambda: load_vocab(['out/ckpt.pt']), r"checkpoint list \['out/ckpt.pt'\]: give a file name"),
             (lambda: load_vocab(path, meta=5), r"meta int 5: give a file name"),
             (lambda: load_drafter(path, 'model'), r"target is str 'model'; want the model.GPT"),
             (lambda: load_drafter(path, model, kind='bpd'), r"kind='bpd': want one of 'heads', 'dblast'"),
             (lambda: load_drafter(path, model, vocab='bytes'), r"vocab is str 'bytes'; want a data.Vocab"),
             (lambda: Vocab('bytes').encode(b'def'), r"the prompt is bytes b'def'; want text"),
             (lambda: Vocab('bytes').decode([[1, 2]]), r"ids list \[\[1, 2\]\]: want a sequence of token ids")]
    for call, match in cases:
        with pytest.raises(BadInput, match=match):
            call()
    assert load_target(path).config == model.config and Vocab('bytes').decode([100, -1, 300, 101]) == 'de'

"""
`python -m exercises handout DIR`: a student's copy of the project in DIR.

The copy leaves out exercises/solutions/. Exercises 1, 2, 3, 5 and 6 re-implement the project's own
functions (their checks.py's REFERENCE), so in the copy those functions keep their signature and
docstring and hand the work to the student's exercises/NN_name/student.py: the project itself
(decode.generate, train.py, bench.py) then runs on the student's code, and an exercise not yet
written stops it with one line, `not written yet: ...` (data.run_script).
"""
import ast
import fnmatch
import os
import shutil
import subprocess

from data import BadInput
from exercises import harness

LEFT_OUT = 'exercises/solutions/'    # the reference answers: never in a handout

# Without git, the files a walk of the project skips: what .gitignore ignores, and git's own folder
SKIP_DIRS = ('.git', 'out', 'bench/ckpt', 'bench/gpu', '__pycache__', '.pytest_cache')
SKIP_FILES = ('*.pyc', '*.tmp', 'bench/*.pt')

# What a rewritten module of the copy gets after its imports. Plain standard library, and it loads
# the student's file by its path: importing the exercises package from model.py would be a circle
# (the harness imports model, decode and dblast, and everything imports model).
LOADER = '''
# handout: the project runs on the student's exercises/*/student.py (python -m exercises handout)
def _student(folder):
    """exercises/<folder>/student.py as a module, loaded once per process."""
    # imported here, not at the top: the rest of the module keeps the names the project gave it
    import importlib.util
    import os
    import sys
    name = 'handout_student_' + folder
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'exercises', folder, 'student.py')
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]      # a student file that fails to load is tried again next time
            raise
    return sys.modules[name]
'''.lstrip('\n').splitlines(keepends=True)


# ----------------------------------------------------------------------------- which files

def project_files():
    """The project's files, relative to its root: what git knows (tracked, or new and not ignored)
    when this is a git checkout, else a walk that skips what .gitignore would."""
    try:
        listed = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
                                cwd=harness.ROOT, capture_output=True, check=True).stdout
        files = [f for f in os.fsdecode(listed).split('\0') if f]
    except (OSError, subprocess.CalledProcessError):   # no git, or not a checkout
        files = list(walk(harness.ROOT))
    # a tracked file deleted from the working tree is still listed: copy only what is there
    return sorted(f for f in files if os.path.isfile(os.path.join(harness.ROOT, f)) and not f.startswith(LEFT_OUT))


def walk(root):
    """Every file under root, as a path relative to it with '/', but SKIP_DIRS and SKIP_FILES."""
    for top, dirs, names in os.walk(root):
        rel = os.path.relpath(top, root).replace(os.sep, '/')
        rel = '' if rel == '.' else rel + '/'
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and rel + d not in SKIP_DIRS)
        yield from (rel + n for n in names if not any(fnmatch.fnmatch(rel + n, p) for p in SKIP_FILES))


# ----------------------------------------------------------------------------- rewriting the answers

def references():
    """[(exercise folder, the student's name, 'module.attr' or 'module.Class.method')] of every
    exercise whose checks.py names its reference in the project's code."""
    return [(folder, name, dotted) for n, folder in harness.exercises().items()
            for name, dotted in getattr(harness.checks_of(n), 'REFERENCE', {}).items()]


def find_function(tree, dotted, filename):
    """The def node of 'module.attr' or 'module.Class.method' in the module's parsed tree. A name
    that is not there is the project's bug (a stale REFERENCE), not the user's: it raises."""
    node = tree
    for part in dotted.split('.')[1:]:
        found = [d for d in node.body if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and d.name == part]
        if not found:
            raise LookupError(f"REFERENCE {dotted!r}: no {part} in {filename}")
        node = found[-1]                           # a name defined twice: the later one is the one used
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise LookupError(f"REFERENCE {dotted!r}: {node.name} in {filename} is not a function")
    return node


def call_arguments(args):
    """The parameters of a signature passed on as it declares them: 'a, b, *rest, kw=kw, **extra'."""
    out = [a.arg for a in args.posonlyargs + args.args]
    out += [f"*{args.vararg.arg}"] if args.vararg else []
    out += [f"{a.arg}={a.arg}" for a in args.kwonlyargs]
    out += [f"**{args.kwarg.arg}"] if args.kwarg else []
    return ', '.join(out)


def delegated(lines, fn, folder, name, dotted):
    """fn's body after its docstring (all of it, if it has none), its comments included -> one call
    of the student's `name`. Returns (first line, last line, new lines), 1-based and inclusive, for
    the caller to splice: every other line of the file stays byte for byte."""
    doc = fn.body[0] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
        and isinstance(fn.body[0].value.value, str) else None
    code = fn.body[1:] if doc else fn.body
    at = (code or fn.body)[0]                      # the call takes this statement's indentation
    indent = lines[at.lineno - 1][:at.col_offset]
    if indent.strip():
        raise ValueError(f"REFERENCE {dotted!r}: its body shares a line with the def or the docstring; "
                         f"the handout rewrites whole lines")
    first = doc.end_lineno + 1 if doc else code[0].lineno
    last = fn.end_lineno
    for j in range(fn.end_lineno, len(lines)):     # comments at the end of the body are the body's too
        if lines[j].startswith(indent) and lines[j].lstrip().startswith('#'):
            last = j + 1
        elif lines[j].strip():
            break
    call = f"{indent}return _student({folder!r}).{name}({call_arguments(fn.args)})\n"
    return first, last, [call]


def first_code_line(tree):
    """Where the loader goes: after the module's imports (the last one before its first def or class)."""
    defs = [d.lineno for d in tree.body if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    imports = [d.end_lineno for d in tree.body if isinstance(d, (ast.Import, ast.ImportFrom))
               and d.lineno < min(defs, default=float('inf'))]
    if not imports:
        raise ValueError("a module to rewrite has no imports before its first def")
    return max(imports)


def rewritten_modules(files):
    """{relative path: new text} of every module holding a reference, read from the project. Done
    before anything is written, so a stale REFERENCE leaves no half-made handout."""
    by_file = {}
    for folder, name, dotted in references():
        path = dotted.split('.')[0] + '.py'
        if path not in files:
            raise LookupError(f"REFERENCE {dotted!r}: no {path} in the project")
        by_file.setdefault(path, []).append((folder, name, dotted))
    out = {}
    for path, refs in by_file.items():
        with open(os.path.join(harness.ROOT, path), encoding='utf-8', newline='') as f:
            source = f.read()
        # lines as ast counts them (str.splitlines would also split at form feeds and the like)
        lines = [line + '\n' for line in source.split('\n')]
        lines[-1] = lines[-1][:-1]
        tree = ast.parse(source, path)
        edits = [delegated(lines, find_function(tree, dotted, path), folder, name, dotted)
                 for folder, name, dotted in refs]
        after = first_code_line(tree)
        blank = 0                                  # blank lines after the imports: two around the loader
        while after + blank < len(lines) and not lines[after + blank].strip():
            blank += 1
        edits.append((after + 1, after, ['\n', '\n'] + LOADER + ['\n'] * max(0, 2 - blank)))   # replaces no line
        for first, last, new in sorted(edits, key=lambda e: e[0], reverse=True):   # bottom up: line numbers hold
            lines[first - 1:last] = new
        out[path] = ''.join(lines)
    return out


# ----------------------------------------------------------------------------- the command

def check_folder(folder):
    """DIR may be new or an empty folder; anything else is refused before a byte is written."""
    if os.path.isdir(folder):
        if os.listdir(folder):
            raise BadInput(f"handout {folder}: not empty; give a new folder or an empty one")
    elif os.path.lexists(folder):
        raise BadInput(f"handout {folder}: a file is there, not a folder; give a new folder or an empty one")


def make(dest):
    """Write the handout into dest (see the module's docstring), then say what it is."""
    check_folder(dest)
    if not any(harness.solution_path(n) for n in harness.exercises()):
        raise BadInput("this copy has no exercises/solutions/: it is a handout already; make one from the "
                       "full project")
    files = project_files()
    modules = rewritten_modules(files)
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as e:
        raise BadInput(f"handout {dest}: cannot create it ({e.strerror})")
    for f in files:
        dst = os.path.join(dest, f)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if f in modules:
            with open(dst, 'w', encoding='utf-8', newline='') as out:
                out.write(modules[f])
            shutil.copymode(os.path.join(harness.ROOT, f), dst)
        else:
            shutil.copy2(os.path.join(harness.ROOT, f), dst)
    summary(dest, len(files))


def summary(dest, n_files):
    number = {folder: n for n, folder in harness.exercises().items()}
    refs = references()
    width = max(len(dotted) for _, _, dotted in refs)
    print(f"wrote a handout of {n_files} files to {dest}, without exercises/solutions/ (every reference "
          f"answer and negative control).\nThe project's own functions that now run the student's "
          f"exercises/NN_name/student.py:")
    for folder, name, dotted in refs:
        print(f"  {dotted:<{width}} -> exercise {number[folder]} ({folder}: {name})")
    others = [str(n) for n, f in harness.exercises().items() if f not in {r[0] for r in refs}]
    print(f"Exercises {', '.join(others)} add to the project instead (their answers were only in "
          f"exercises/solutions/); decode.py keeps its tree verification (merged_step with paths=K, "
          f"exercise 8's reference).")
    print("Order: exercise 3 first, since every decode runs on the student's cache (plain decoding, `python "
          "generate.py` without a drafter, runs once it is written), then 1, 2, 4 to 8: a check that decodes runs "
          "the earlier exercises' code too (exercise 3's last check needs exercise 1's verify_greedy).")
    print(f"Next: cd {dest} && python -m exercises check 3")

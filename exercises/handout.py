"""
`python -m exercises handout DIR`: a student's copy of the project in DIR, with no answer in it.

Each exercise's checks.py names, in the project's code, what its student writes (its answer) and
what the student may read:

    REFERENCE  {student's name: 'module.attr'}: the project's own function the student re-implements.
               In the copy it keeps its signature and docstring, and its body becomes one call of
               the student's exercises/NN_name/student.py: the project (decode.generate, train.py,
               bench.py) then runs on the student's code.
    STUBS      {entry: why}: the rest of the answer's substance, the helpers it is made of. In the
               copy each body is gone: it raises NotImplementedError, naming the exercise. An entry
               is 'module.attr' or 'module.Class.method' (the whole body), or that followed by
               ' [if TEST]' (the body of every `if TEST:` in it) or ' [else of TEST]' (the `else:`
               of `if TEST:`), for an answer that is one branch of a function the rest of the
               project needs.
    MAY_USE    ('module.attr', ...): what the statement lets the student call (README.md says so).

The copy leaves out exercises/solutions/ (the reference answers and negative controls), and an
exercise not yet written stops a script with one line, `not written yet: exercise N: ...`
(cli.run_script).
"""
import ast
import fnmatch
import os
import re
import shutil
import subprocess
import tempfile
import textwrap

from cli import BadInput
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

ENTRY = re.compile(r'(?P<dotted>[\w.]+)(?: \[(?P<arm>if|else of) (?P<test>.+)\])?')


# ----------------------------------------------------------------------------- what comes out

def entries():
    """[(exercise number, folder, entry, kind, what)] of every body a handout takes out: kind
    'student' (a REFERENCE: what is the student's name for it) or 'stub' (a STUBS entry: what
    says why it is the answer's)."""
    out = []
    for n, folder in harness.exercises().items():
        checks = harness.checks_of(n)
        out += [(n, folder, dotted, 'student', name) for name, dotted in getattr(checks, 'REFERENCE', {}).items()]
        out += [(n, folder, entry, 'stub', why) for entry, why in getattr(checks, 'STUBS', {}).items()]
    return out


def parse_entry(entry):
    """'decode.merged_step [if paths > 1]' -> ('decode.merged_step', 'if', 'paths > 1');
    'verification.residual' -> ('verification.residual', None, None)."""
    m = ENTRY.fullmatch(entry)
    if m is None:
        raise ValueError(f"STUBS {entry!r}: want 'module.attr', optionally followed by ' [if TEST]' or "
                         f"' [else of TEST]'")
    return m['dotted'], m['arm'], m['test']


def refusal(n, entry, why):
    """What a stubbed body raises: one line that names the exercise first, as a student's stub does."""
    return f"exercise {n}: {entry} is part of exercise {n}'s answer, left out of this handout ({why})"


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

def find_function(tree, dotted, filename):
    """The def node of 'module.attr' or 'module.Class.method' in the module's parsed tree. A name
    that is not there is the project's bug (a stale REFERENCE or STUBS), not the user's: it raises."""
    node = tree
    for part in dotted.split('.')[1:]:
        found = [d for d in node.body if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and d.name == part]
        if not found:
            raise LookupError(f"{dotted!r}: no {part} in {filename}")
        node = found[-1]                           # a name defined twice: the later one is the one used
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise LookupError(f"{dotted!r}: {node.name} in {filename} is not a function")
    return node


def branches(fn, test):
    """Every `if` statement inside fn (not inside a nested def) whose test reads `test`."""
    found, todo = [], list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and ast.unparse(node.test) == test:
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda node: node.lineno)


def call_arguments(args):
    """The parameters of a signature passed on as it declares them: 'a, b, *rest, kw=kw, **extra'."""
    out = [a.arg for a in args.posonlyargs + args.args]
    out += [f"*{args.vararg.arg}"] if args.vararg else []
    out += [f"{a.arg}={a.arg}" for a in args.kwonlyargs]
    out += [f"**{args.kwarg.arg}"] if args.kwarg else []
    return ', '.join(out)


def with_trailing_comments(lines, last, indent):
    """The last line (1-based) of a body that ends at line `last`: comments after it at the body's
    indentation are the body's too."""
    for j in range(last, len(lines)):
        if lines[j].startswith(indent) and lines[j].lstrip().startswith('#'):
            last = j + 1
        elif lines[j].strip():
            break
    return last


def body_lines(lines, statements, first, what):
    """(first line, last line, indentation) of a body made of `statements` that starts at line
    `first` (1-based; comments before its first statement included)."""
    at = statements[0]
    indent = lines[at.lineno - 1][:at.col_offset]
    if indent.strip():
        raise ValueError(f"{what}: its body shares a line with the line before it; the handout rewrites whole lines")
    return first, with_trailing_comments(lines, statements[-1].end_lineno, indent), indent


def function_body(lines, fn, what):
    """The lines of fn's body after its docstring (all of it, if it has none), its comments included."""
    doc = fn.body[0] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
        and isinstance(fn.body[0].value.value, str) else None
    code = fn.body[1:] if doc else fn.body
    if not code:
        raise ValueError(f"{what}: a function with nothing but a docstring")
    return body_lines(lines, code, doc.end_lineno + 1 if doc else code[0].lineno, what)


def arm_lines(lines, node, arm, what):
    """The lines of one arm of an `if` node: its body ('if'), or its `else:` block ('else of')."""
    if arm == 'if':
        return body_lines(lines, node.body, node.test.end_lineno + 1, what)
    if not node.orelse:
        raise LookupError(f"{what}: that `if` has no else")
    j = node.body[-1].end_lineno                   # the `else:` line: the first after the body to start so
    while not re.match(r'\s*else\s*:', lines[j]):
        if re.match(r'\s*elif\b', lines[j]):
            raise LookupError(f"{what}: an elif, not an else")
        j += 1
    return body_lines(lines, node.orelse, j + 2, what)


def edits_of(lines, tree, path, n, folder, entry, kind, what):
    """[(first line, last line, new lines)] that take one entry's body out (1-based, inclusive)."""
    dotted, arm, test = parse_entry(entry)
    fn = find_function(tree, dotted, path)
    if kind == 'student':
        first, last, indent = function_body(lines, fn, entry)
        return [(first, last, [f"{indent}return _student({folder!r}).{what}({call_arguments(fn.args)})\n"])]
    if arm is None:
        spans = [function_body(lines, fn, entry)]
    else:
        found = branches(fn, test)
        if not found:
            raise LookupError(f"STUBS {entry!r}: no `if {test}:` in {dotted}")
        spans = [arm_lines(lines, node, arm, entry) for node in found]
    return [(first, last, raising(indent, refusal(n, entry, what))) for first, last, indent in spans]


def raising(indent, message, width=118):
    """The lines of `raise NotImplementedError(message)` at indent, the message cut into string
    literals, one a line, so that no line passes `width` characters."""
    head = f"{indent}raise NotImplementedError("
    parts = textwrap.wrap(message, max(40, width - len(head) - 3), break_long_words=False, drop_whitespace=False)
    quoted = ['"' + p.replace('\\', '\\\\').replace('"', '\\"') + '"' for p in parts]
    lines = [head + quoted[0]] + [' ' * len(head) + q for q in quoted[1:]]
    return [line + '\n' for line in lines[:-1]] + [lines[-1] + ')\n']


def first_code_line(tree):
    """Where the loader goes: after the module's imports (the last one before its first def or class)."""
    defs = [d.lineno for d in tree.body if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    imports = [d.end_lineno for d in tree.body if isinstance(d, (ast.Import, ast.ImportFrom))
               and d.lineno < min(defs, default=float('inf'))]
    if not imports:
        raise ValueError("a module to rewrite has no imports before its first def")
    return max(imports)


def rewritten_modules(files):
    """{relative path: new text} of every module an entry is in, read from the project. Done before
    anything is written, so a stale entry leaves no half-made handout."""
    by_file = {}
    for n, folder, entry, kind, what in entries():
        path = parse_entry(entry)[0].split('.')[0] + '.py'
        if path not in files:
            raise LookupError(f"{entry!r} (exercise {n}): no {path} in the project")
        by_file.setdefault(path, []).append((n, folder, entry, kind, what))
    out = {}
    for path, found in by_file.items():
        with open(os.path.join(harness.ROOT, path), encoding='utf-8', newline='') as f:
            source = f.read()
        # lines as ast counts them (str.splitlines would also split at form feeds and the like)
        lines = [line + '\n' for line in source.split('\n')]
        lines[-1] = lines[-1][:-1]
        tree = ast.parse(source, path)
        edits = [e for item in found for e in edits_of(lines, tree, path, *item)]
        spans = sorted((first, last) for first, last, _ in edits)
        for (_, last), (first, _) in zip(spans, spans[1:]):
            if first <= last:
                raise ValueError(f"{path}: two entries take out overlapping lines (around line {first})")
        if any(kind == 'student' for _, _, _, kind, _ in found):
            after = first_code_line(tree)
            blank = 0                              # blank lines after the imports: two around the loader
            while after + blank < len(lines) and not lines[after + blank].strip():
                blank += 1
            edits.append((after + 1, after, ['\n', '\n'] + LOADER + ['\n'] * max(0, 2 - blank)))   # replaces no line
        for first, last, new in sorted(edits, key=lambda e: e[0], reverse=True):   # bottom up: line numbers hold
            lines[first - 1:last] = new
        out[path] = ''.join(lines)
    return out


# ----------------------------------------------------------------------------- the command

def check_folder(folder):
    """DIR may be new or an empty folder, outside the project, where files can be written;
    anything else is refused before a byte is written."""
    if not folder:
        raise BadInput("handout: the folder's name is empty; give a new folder or an empty one")
    real, root = os.path.realpath(folder), os.path.realpath(harness.ROOT)
    if real == root or real.startswith(root + os.sep):
        raise BadInput(f"handout {folder}: inside the project; give a folder outside it (the copy is made "
                       f"from the project's files)")
    if os.path.isdir(folder):
        if os.listdir(folder):
            raise BadInput(f"handout {folder}: not empty; give a new folder or an empty one")
        where = folder
    elif os.path.lexists(folder):
        raise BadInput(f"handout {folder}: a file is there, not a folder; give a new folder or an empty one")
    else:
        where = os.path.dirname(os.path.abspath(folder))    # the folder DIR would be made in
        while not os.path.lexists(where):
            where = os.path.dirname(where)
        if not os.path.isdir(where):
            raise BadInput(f"handout {folder}: {where} is a file, not a folder; give a new folder or an empty one")
    try:   # as root, permission bits do not say whether a write works: try one
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise BadInput(f"handout {folder}: cannot write in {where} ({e.strerror or type(e).__name__}); give a "
                       f"folder where you can")


def make(dest):
    """Write the handout into dest (see the module's docstring), then say what it is. A write that
    fails, or Ctrl-C, removes what was written: no half-made handout is left."""
    check_folder(dest)
    if not any(harness.solution_path(n) for n in harness.exercises()):
        raise BadInput("this copy has no exercises/solutions/: it is a handout already; make one from the "
                       "full project")
    files = project_files()
    modules = rewritten_modules(files)
    made = not os.path.isdir(dest)
    try:
        os.makedirs(dest, exist_ok=True)
        for f in files:
            dst = os.path.join(dest, f)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if f in modules:
                with open(dst, 'w', encoding='utf-8', newline='') as out:
                    out.write(modules[f])
                shutil.copymode(os.path.join(harness.ROOT, f), dst)
            else:
                shutil.copy2(os.path.join(harness.ROOT, f), dst)
    except BaseException as e:
        remove(dest, made)
        if isinstance(e, OSError):
            raise BadInput(f"handout {dest}: writing the copy failed ({e.strerror or type(e).__name__}); "
                           f"nothing was left there")
        raise
    summary(dest, len(files))


def remove(dest, made):
    """Remove what make() wrote: dest itself if it made it, else what is inside it."""
    if made:
        shutil.rmtree(dest, ignore_errors=True)
        return
    for name in os.listdir(dest):
        path = os.path.join(dest, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) and not os.path.islink(path) \
            else os.remove(path)


def summary(dest, n_files):
    found = entries()
    width = max(len(entry) for _, _, entry, _, _ in found)
    print(f"wrote a handout of {n_files} files to {dest}, without exercises/solutions/ (every reference "
          f"answer and negative control).\nThe project's own functions that now run the student's "
          f"exercises/NN_name/student.py:")
    for n, folder, entry, kind, what in found:
        if kind == 'student':
            print(f"  {entry:<{width}} -> exercise {n} ({folder}: {what})")
    print("Left out, as part of an exercise's answer (they refuse with one line, naming the exercise):")
    for n, folder, entry, kind, _ in found:
        if kind == 'stub':
            print(f"  {entry:<{width}}    exercise {n} ({folder})")
    print("So several drafted paths per call (generate.py --paths, exercise 8's subject) need the full project.")
    print("Order: exercise 3 first, since every decode runs on the student's cache (plain decoding, `python "
          "generate.py` without a drafter, runs once it is written), then 1, 2, 4 to 9: a check that decodes runs "
          "the earlier exercises' code too (exercise 3's last check needs exercise 1's verify_greedy).")
    print(f"Next: cd {dest} && python -m exercises check 3")

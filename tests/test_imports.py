"""The project's imports run one way, in reading order (README, "Files"): a module imports only the
modules before it, at its top, never inside a function (which would hide a circle)."""
import ast
import os

import pytest

from conftest import ROOT

ORDER = ['model', 'cli', 'data', 'heads', 'dblast', 'drafters', 'runner', 'arguments', 'verification', 'decode',
         'generate', 'trainer', 'train', 'measure', 'bench', 'gpu_check']


def project_imports(name):
    """(module imported, line, at the top level?) for every import of a project module in name.py."""
    tree = ast.parse(open(os.path.join(ROOT, name + '.py')).read())
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name.split('.')[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods = [node.module.split('.')[0]]
        else:
            continue
        found += [(m, node.lineno, id(node) in top) for m in mods if m in ORDER]
    return found


def test_every_top_level_module_is_in_the_order():
    scripts = {f[:-3] for f in os.listdir(ROOT) if f.endswith('.py')}
    assert scripts == set(ORDER), "a new top-level module needs its place in ORDER (and in the README's Files)"


@pytest.mark.parametrize('name', ORDER)
def test_imports_run_one_way(name):
    for mod, line, at_top in project_imports(name):
        assert at_top, f"{name}.py:{line} imports {mod} inside a function"
        assert ORDER.index(mod) < ORDER.index(name), f"{name}.py:{line} imports {mod}, which comes after it"

"""
The coursework exercises (exercises/README.md).

    python -m exercises                      # the list
    python -m exercises check 2              # exercise 2's checks on your exercises/02_*/student.py
    python -m exercises check 2 --solution   # the same checks on the reference
    python -m exercises try 2                # your code through the real decoder, on train.py's out/
    python -m exercises handout DIR          # instructors: a student's copy of the project in DIR
"""
import os
import signal
import sys

if __name__ == '__main__' and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    # Ctrl-C while the imports below load (seconds on a busy machine): the one line cli.run_script
    # prints later too, not a traceback from inside torch's import
    signal.signal(signal.SIGINT, lambda *_: (sys.stderr.write('\ninterrupted\n'), os._exit(130)))

import argparse
import time

import torch

from exercises import handout, harness, worker
from cli import ArgumentParser, BadInput, check_number, intra_op_threads, pick_device, run_script


def print_list():
    print("The exercises (statement: exercises/NN_name/README.md; your code: its student.py):\n")
    for n, name in harness.exercises().items():
        title = open(os.path.join(harness.HERE, name, 'README.md')).readline().lstrip('# ').strip()
        print(f"  {n}  {name:<20} {title}")
    if harness.solution_path(3) is None:   # a handout: the project decodes on the student's cache
        print("\nStart with exercise 3: in this copy every decode runs on your cache (then 1, 2 and 4 to 9).")
    print("\npython -m exercises check N       run exercise N's checks on your student.py (--solution: the reference)"
          "\npython -m exercises try N         run your code through the decoder on train.py's checkpoints"
          "\npython -m exercises handout DIR   instructors: write a student's copy (no solutions) into DIR")


def check(n, which):
    """Run exercise n's checks on `which` in a worker process (exercises/worker.py), printing each
    result as it comes; True when every one passed."""
    what = {'student': f"exercises/{harness.exercises()[n]}/student.py", 'solution': 'the reference'}.get(
        which, f"the negative control '{which}'")
    print(f"exercise {n} ({harness.exercises()[n]}), checks on {what}:", flush=True)
    t0 = time.perf_counter()
    run = worker.Run(n, which)
    width = max(len(harness.docstring_parts(fn)[0]) for _, fn in run.functions)
    passed = 0
    for r in run:
        print(f"  {'PASS' if r.passed else 'FAIL'}  {r.title:<{width}}  ({r.seconds:.1f}s)")
        if not r.passed:
            print(f"        why:  {r.reason}")
            if r.hint and not r.not_written:
                print(f"        hint: {r.hint}")
        sys.stdout.flush()
        passed += r.passed
    if run.tampered:
        print(f"no check of this run counts: {run.tampered}")
        passed = 0
    print(f"{passed} of {len(run.functions)} checks pass ({time.perf_counter() - t0:.1f}s)")
    return passed == len(run.functions)


TRY_FLAGS = ('out_dir', 'prompts', 'max_new', 'device')     # flags only `try` reads (None: not given)


def given(args, names):
    """The command-line spelling of every flag in names that was given."""
    return ['--' + n.replace('_', '-') for n in names if getattr(args, n) not in (None, False)]


def check_flags(args):
    """Every flag against the command, before any work: what a command does not read is refused,
    rather than ignored."""
    meaningless = {'list': ('solution', 'control', 'threads') + TRY_FLAGS,
                   'handout': ('solution', 'control', 'threads') + TRY_FLAGS,
                   'check': TRY_FLAGS, 'try': ()}[args.command]
    extra = given(args, meaningless)
    if extra:
        allowed = {'list': 'no flags', 'handout': 'no flags', 'check': '--solution, --control and --threads',
                   'try': ''}[args.command]
        raise BadInput(f"{args.command}: {', '.join(extra)} {'means' if len(extra) == 1 else 'mean'} nothing "
                       f"here ({args.command} takes {allowed})")
    if args.command == 'list' and args.number is not None:
        raise BadInput(f"list {args.number}: list takes nothing after it; the statement of exercise N is "
                       f"exercises/NN_name/README.md, and `python -m exercises check N` runs its checks")
    if args.solution and args.control:
        raise BadInput("--solution and --control: give one (the reference, or one negative control)")
    if args.control is not None and not args.control.strip():
        raise BadInput("--control '': give a control's name (python -m exercises check N --control bogus lists them)")


def try_device(name):
    """--device for try: one this machine has (cli.pick_device), and a CPU without an index."""
    name = pick_device('cpu' if name is None else name)
    if torch.device(name).type == 'cpu' and torch.device(name).index not in (None, 0):
        raise BadInput(f"--device {name}: a CPU has no device {torch.device(name).index}; use cpu")
    return name


def make_handout(args):
    if args.number is None:
        raise BadInput("handout: give the folder to write the student's copy into "
                       "(python -m exercises handout DIR; a new folder or an empty one)")
    handout.make(args.number)


def main(argv=None):
    ap = ArgumentParser(prog='python -m exercises', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('command', nargs='?', choices=['list', 'check', 'try', 'handout'], default='list')
    # one positional after the command: check and try take a number, handout a folder
    ap.add_argument('number', nargs='?', metavar='N|DIR', help='check, try: the exercise; handout: the folder to write')
    ap.add_argument('--solution', action='store_true', help='run the reference instead of student.py')
    ap.add_argument('--control', default=None, help='check, try: run a negative control (a plausible wrong answer)')
    ap.add_argument('--out-dir', default=None, help="try: train.py's checkpoints (default out/)")
    ap.add_argument('--prompts', type=int, default=None,
                    help='try: held-out prompts, decoded one at a time (default 8)')
    ap.add_argument('--max-new', type=int, default=None, help='try: tokens per prompt (default 128)')
    ap.add_argument('--device', default=None, help='try: cpu (default), cuda, cuda:N or mps')
    ap.add_argument('--threads', type=int, default=None,
                    help="check, try: CPU threads (default: the cores not already busy, from /proc/stat over 0.2 s)")
    args = ap.parse_args(argv)
    check_flags(args)
    if args.command == 'list':
        print_list()
        return
    if args.command == 'handout':
        make_handout(args)
        return
    numbers = harness.exercises()
    if args.number is None:
        raise BadInput(f"{args.command}: give an exercise number ({', '.join(map(str, numbers))})")
    try:
        args.number = int(args.number)
    except ValueError:
        raise BadInput(f"{args.command} {args.number}: not an exercise number; choose one of "
                       f"{', '.join(map(str, numbers))}")
    if args.number not in numbers:
        raise BadInput(f"exercise {args.number}: choose one of {', '.join(map(str, numbers))}")
    if args.threads is not None:
        check_number('--threads', args.threads, lo=1, hi=1024)
    if args.command == 'try':
        args.out_dir = 'out' if args.out_dir is None else args.out_dir
        args.prompts = 8 if args.prompts is None else check_number('--prompts', args.prompts, lo=1, hi=10_000)
        args.max_new = 128 if args.max_new is None else check_number('--max-new', args.max_new, lo=1, hi=1_000_000)
        if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
            raise BadInput(f"--out-dir {args.out_dir}: a file, not a folder; give train.py's --out-dir")
        args.device = try_device(args.device)
    if (args.solution or args.control) and harness.solution_path(args.number) is None:
        raise BadInput(f"no exercises/solutions/{numbers[args.number]}.py here (a handout without solutions)")
    if args.control and args.control not in harness.controls(args.number):
        raise BadInput(f"--control {args.control!r}: exercise {args.number}'s controls are "
                       + '; '.join(repr(c) for c in harness.controls(args.number)))
    intra_op_threads(args.threads)
    which = args.control or ('solution' if args.solution else 'student')
    if args.command == 'check':
        sys.exit(0 if check(args.number, which) else 1)
    harness.try_out(args.number, which, args)


if __name__ == '__main__':
    run_script(main)

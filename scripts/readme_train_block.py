"""The README's ``qkmonitor train`` output block, regenerated from a fresh run.

Runs ``qkmonitor train`` (its defaults, or the arguments given, e.g. ``--log-dir DIR``) in a
subprocess under the environment the README states (torch on the CPU, the thread count the model
chooses: ``OMP_NUM_THREADS`` unset, no GPU visible), captures what it prints, takes out what varies
from run to run and machine to machine (the progress bar's updates and times, the log directory)
and writes the result between ``<!-- train-output:start -->`` and ``<!-- train-output:end -->``
in README.md. The paragraph under the block (date, machine, load, the command and its time) is
the writer's to update; the script prints the run's time for it.

``--check`` writes nothing: it compares the fresh run's block with the README's by structure
(``shape``: every line with its numbers taken out, so the header, the summary's columns and rows,
the legend, the alerts fired and the rules watched, the validation line's fields and ``Next:``
must match exactly) and exits 1 on a difference. The slow test
``tests/cli/test_train.py::test_default_run_learns_associative_recall`` runs the same comparison
through these functions, and the figures within the tolerance the README states.

Usage::

    python scripts/readme_train_block.py                      # rerun and rewrite the block
    python scripts/readme_train_block.py --log-dir /tmp/qs3   # arguments go to qkmonitor train
    python scripts/readme_train_block.py --check              # compare only; exit 1 if it differs
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START, END = "<!-- train-output:start -->", "<!-- train-output:end -->"
#: The block as it sits between the markers: one fenced code block.
BLOCK = re.compile(re.escape(START) + r"\n```\n(.*?)```\n" + re.escape(END), re.DOTALL)
#: The log root the README shows, the default's (``--log-dir runs``).
SHOWN_ROOT = "runs"
BAR = re.compile(r"^step:\s*(\d+)%\|[^|]*\|\s*(\d+)/(\d+)\b.*$")
BAR_WIDTH = 10


def last_state(line: str) -> str:
    """What a terminal shows of a line a progress bar rewrote with carriage returns: its last
    non-empty state."""
    states = [state for state in line.split("\r") if state.strip()]
    return states[-1] if states else ""


def bar_line(line: str) -> str:
    """A progress bar's final state without its times and rates:
    ``step: 100%|██████████| 1500/1500 [...]``; any other line as it is."""
    match = BAR.match(line)
    if not match:
        return line
    percent, done, total = (int(g) for g in match.groups())
    full = BAR_WIDTH * percent // 100
    return f"step: {percent}%|{'█' * full}{' ' * (BAR_WIDTH - full)}| {done}/{total} [...]"


def _path_pattern(path: str) -> re.Pattern:
    """``path`` where it stands as a whole path or a path's leading folders."""
    return re.compile(r"(?<![\w./-])" + re.escape(path) + r"(?=/|\s|\)|$)", re.MULTILINE)


def shown_log_dir(text: str) -> str:
    """The run's log directory as the default's: the log root (``tensorboard --logdir``'s
    argument) read as ``runs``, the run's version as ``version_0``, as on a fresh ``runs/``."""
    logs = re.search(r"; logs: (\S+)$", text, re.MULTILINE)
    root = re.search(r"^  tensorboard --logdir (\S+)", text, re.MULTILINE)
    if not (logs and root):
        return text
    run_dir, root_dir = (shlex.split(m.group(1))[0] for m in (logs, root))
    shown_run = run_dir
    if run_dir.startswith(root_dir + "/"):
        shown_run = SHOWN_ROOT + run_dir[len(root_dir) :]
    shown_run = re.sub(r"/version_\d+$", "/version_0", shown_run)
    text = _path_pattern(run_dir).sub(lambda _: shown_run, text)
    return _path_pattern(root_dir).sub(lambda _: SHOWN_ROOT, text)


def align_next(text: str) -> str:
    """The commands under ``Next:`` with their comments lined up again (as the CLI lines them up)
    after their paths changed length."""
    head, sep, tail = text.partition("\nNext:\n")
    if not sep:
        return text
    lines = tail.split("\n")
    commands = [re.match(r"^  (.*?)\s+# (.*)$", line) for line in lines]
    n = next((i for i, m in enumerate(commands) if m is None), len(lines))
    width = max((len(m.group(1)) for m in commands[:n]), default=0)
    aligned = [f"  {m.group(1).ljust(width)}  # {m.group(2)}" for m in commands[:n]]
    return head + sep + "\n".join(aligned + lines[n:])


def normalise(stdout: str) -> str:
    """What ``qkmonitor train`` printed, as the README shows it: each line as a terminal leaves
    it, the progress bar's final state without times and rates, the log directory the default's,
    the ``Next:`` commands lined up, no trailing blanks; ends with one newline."""
    lines = [bar_line(last_state(line).rstrip()) for line in stdout.split("\n")]
    # a bar's states on lines of their own (its carriage returns read as new lines, the first
    # one's too): the last state, with no blank line before the bar
    lines = [
        line
        for line, after in zip(lines, [*lines[1:], ""])
        if not ((line.startswith("step:") or not line) and after.startswith("step:"))
    ]
    text = "\n".join(lines).strip("\n")
    return align_next(shown_log_dir(text)) + "\n"


def shape(block: str) -> list[str]:
    """A block's structure: each non-empty line with every number as ``#`` and runs of spaces as
    one, the progress bar left out (a run without one, ``--no-progress-bar``, has the same
    shape). Words stay: the header's, the columns, the layers' names, the legend, which alerts
    fired and the rules watched, the validation line's fields, ``Next:``."""
    lines = []
    for line in block.splitlines():
        line = re.sub(r"[-+]?\d[\d.e+-]*|\bnan\b", "#", line)
        line = re.sub(r"\s+", " ", line).strip()
        if line and not line.startswith("step:"):
            lines.append(line)
    return lines


def read_block(readme: str) -> str:
    """The text of the README's train-output block (inside its code fence).

    Raises:
        ValueError: the markers or the fence around the block are missing.
    """
    match = BLOCK.search(readme)
    if not match:
        raise ValueError(f"expected a fenced code block between `{START}` and `{END}`")
    return match.group(1)


def replace_block(readme: str, block: str) -> str:
    """The README with ``block`` (normalised text, ending with a newline) between the markers.

    Raises:
        ValueError: the markers or the fence around the block are missing.
    """
    read_block(readme)
    body = block if block.endswith("\n") else block + "\n"
    return BLOCK.sub(lambda _: f"{START}\n```\n{body}```\n{END}", readme, count=1)


def differences(fresh: str, shown: str) -> list[str]:
    """The structural differences between a fresh block and the README's, as a unified diff of
    their shapes; empty where they agree."""
    return list(
        difflib.unified_diff(shape(shown), shape(fresh), "README.md", "fresh run", lineterm="")
    )


def readme_environment() -> dict[str, str]:
    """This process's environment as the README's run had it: no ``OMP_NUM_THREADS`` (the CLI
    then picks one thread for the small default model) and no GPU (``1500 steps on cpu``)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_train(args: list[str], timeout: float = 1200) -> str:
    """``qkmonitor train`` with ``args`` in a subprocess; its stdout. Without ``--log-dir`` it
    runs in a temporary folder, so its ``runs/`` is a fresh one and nothing is left behind.

    Raises:
        subprocess.CalledProcessError: the run failed (its stderr is in the error).
    """
    command = [sys.executable, "-m", "qkmonitor.cli", "train", *args]
    own_dir = not any(a == "--log-dir" or a.startswith("--log-dir=") for a in args)
    with tempfile.TemporaryDirectory(prefix="readme_train_block_") as tmp:
        done = subprocess.run(
            command,
            capture_output=True,  # bytes: text mode would read the bar's \r as new lines
            env=readme_environment(),
            cwd=tmp if own_dir else None,
            timeout=timeout,
            check=False,
        )
    if done.stderr:
        sys.stderr.write(done.stderr.decode(errors="replace"))
    done.check_returncode()
    return done.stdout.decode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Other arguments go to `qkmonitor train`.",
    )
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if it differs")
    parser.add_argument("--readme", type=Path, default=README, help="default: README.md")
    args, train_args = parser.parse_known_args(argv)
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    readme = args.readme.read_text()
    shown = read_block(readme)
    began = time.perf_counter()
    fresh = normalise(run_train(train_args))
    took = time.perf_counter() - began
    diff = differences(fresh, shown)
    if args.check:
        print("\n".join(diff) if diff else f"{args.readme}: the block's structure holds")
        return 1 if diff else 0
    args.readme.write_text(replace_block(readme, fresh))
    print(f"{args.readme}: block rewritten ({'structure changed' if diff else 'same structure'})")
    print(f"the run took {took:.0f} s; update the paragraph under the block (date, machine, time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A plain loop that drives the engines with ``begin``/``end`` (no ``with monitoring.step``) and is
interrupted mid-probe outside the model's forward function (issue 59, item 12): a Ctrl+C in the
backward, or in a hook of the model's own call, which the forward's interrupt guard does not see.
The next ``begin`` closes the window left open, with one warning, and measures its own step; a
process that ends without ``close()`` leaves nothing on the model at its exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.models import DecoderLM, TransformerConfig
from qkmonitor.output.sinks import MemorySink

ROOT = Path(__file__).resolve().parents[2]


def interrupt(*args):
    raise KeyboardInterrupt


def interrupted_step(model, monitoring, tokens, where: str) -> None:
    """One probed step of a loop without ``with``, interrupted ``where``; the loop catches the
    interrupt as a notebook cell or a ``try`` around the loop does, and calls nothing."""
    handles = []
    if where == "model's call":  # a hook of the model's own call: outside its forward function
        handles.append(model.register_forward_hook(interrupt))
    try:
        monitoring.begin(1)
        loss = model(tokens).logsumexp(-1).mean()
        loss.register_hook(interrupt)  # a Ctrl+C while the backward runs
        loss.backward()
        monitoring.end()
    except KeyboardInterrupt:
        pass
    finally:
        for handle in handles:
            handle.remove()


def make_run():
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=2, max_seq_len=8)
    model = DecoderLM(config)
    engines = [QKSpectrum(), AttentionEntropy(), EffectiveRank(max_probe_tokens=6)]
    sink = MemorySink()
    monitoring = Monitoring(model, engines, writer=sink, every_n_steps=1)
    tokens = torch.randint(16, (4, 8), generator=torch.Generator().manual_seed(0))
    return model, monitoring, sink, tokens


@pytest.mark.parametrize("where", ["backward", "model's call"])
def test_the_next_begin_closes_a_window_an_interrupt_left_open_and_says_so(where, leftovers):
    model, monitoring, sink, tokens = make_run()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitoring.begin(0)
        model(tokens).logsumexp(-1).mean().backward()
        monitoring.end()
    interrupted_step(model, monitoring, tokens, where)
    assert leftovers(model) != []  # the window of step 1 is open: its probes are on the model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitoring.begin(2)
    told = [str(w.message) for w in caught if "left open" in str(w.message)]
    assert len(told) == 1, told
    assert told[0].startswith("qkmonitor: the window of step 1 was left open")
    assert "; begin(2) came, so its probes are closed now, unlogged." in told[0]
    assert "monitoring.abort()" in told[0]

    # the step that follows is measured and logged at its own step, the interrupted one never
    model(tokens).logsumexp(-1).mean().backward()
    monitoring.end()
    assert leftovers(model) == []
    entropy = monitoring.engines[1]
    assert entropy.schedule.latest_step == 2
    steps = {step for tag, _, step in sink.scalars if tag.startswith("qkmonitor/entropy_norm/")}
    assert steps == {0, 2}
    monitoring.close()
    assert leftovers(model) == []


#: the loop above in a process that ends without ``close()``: a check registered with atexit before
#: qkmonitor is imported runs after qkmonitor's own exit handler (atexit runs them last in, first
#: out) and prints what is left on the model
AT_EXIT = """
import atexit, sys
sys.path.insert(0, {root!r})

@atexit.register
def check():
    print("left at exit:", probe_leftovers(run[0]))

import warnings
warnings.simplefilter("ignore")
from tests.conftest import probe_leftovers
from tests.engine.test_abandoned_windows import interrupted_step, make_run

run = make_run()
interrupted_step(run[0], run[1], run[3], {where!r})
print("left after the interrupt:", len(probe_leftovers(run[0])) > 0)
"""


def assert_nothing_left_at_exit(script: Path) -> None:
    """Run ``script`` (which interrupts a probed step and prints what it left, then what was left
    when the interpreter exited) in a process of its own: something left after the interrupt,
    nothing at exit."""

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(script)],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=script.parent,
        )

    done = run()
    if done.returncode == -6 and "terminate called without an active exception" in done.stderr:
        # seen once in 2026-12-07's CI at the minimums (the HF Trainer's script, SIGABRT in C++
        # teardown after the interrupted backward) and in none of 9 reruns, alone or six at once:
        # run once more, and say so, until its cause is found
        print(f"the script aborted at teardown; once more. stdout: {done.stdout[-500:]!r}")
        done = run()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "left after the interrupt: True" in done.stdout, done.stdout
    assert "left at exit: []" in done.stdout, done.stdout


@pytest.mark.parametrize("where", ["backward", "model's call"])
def test_a_window_left_open_is_closed_at_the_interpreters_exit(tmp_path, where):
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(AT_EXIT.format(root=str(ROOT), where=where)))
    assert_nothing_left_at_exit(script)

"""The interceptor hands the capture exactly the calls it reads and passes every other one on,
unhashable callables included."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qkmonitor.attention.capture_mode import Interceptor


class _Recorder:
    """A stand-in capture that records which of its handlers were called."""

    in_kernel = False

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_projection(self, func, args, kwargs) -> None:
        self.seen.append("projection")

    def on_softmax(self, args, kwargs) -> None:
        self.seen.append("softmax")


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_read_calls_reach_the_capture_and_others_pass_on() -> None:
    recorder = _Recorder()
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with Interceptor(recorder):
        out = F.linear(x, w)
        relu = torch.relu(x)
        probs = F.softmax(x, dim=-1)
    assert recorder.seen == ["projection", "softmax"]
    torch.testing.assert_close(out, x @ w.T)
    torch.testing.assert_close(relu, x.clamp_min(0))
    torch.testing.assert_close(probs, torch.exp(x) / torch.exp(x).sum(-1, keepdim=True))


def test_an_unhashable_callable_is_passed_on() -> None:
    recorder = _Recorder()
    x = torch.randn(3)
    out = Interceptor(recorder).__torch_function__(_Unhashable(), (), (x,), None)
    torch.testing.assert_close(out, x * 2)
    assert recorder.seen == []

"""A live TensorBoard on a small monitored run, and headless Chromium to look at it.

Chromium is driven over the Chrome DevTools Protocol on a pipe (``--remote-debugging-pipe``:
JSON messages ended by a NUL byte, on file descriptors 3 and 4 of the browser), so no port, no
websocket and no extra package is needed. TensorBoard's dashboards are Polymer elements inside
shadow roots, which ``--dump-dom`` does not show; the checks run JavaScript in the page that walks
the shadow roots instead.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_NAME = "tiny/version_0"  # the run as TensorBoard names it: logger name / version
UPDATE_SCREENSHOTS = os.environ.get("QKMONITOR_UPDATE_SCREENSHOTS") == "1"


def find_chromium() -> str | None:
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium"
    return shutil.which("chromium")


class CDPError(RuntimeError):
    """A DevTools command that failed."""


class BrowserGone(CDPError):
    """Chromium stopped answering or closed the pipe."""


class Chromium:
    """Headless Chromium with one page, spoken to over the DevTools protocol on a pipe."""

    def __init__(self, executable: str, profile_dir: Path, log_path: Path, timeout: float = 30.0):
        self.timeout = timeout
        self.log_path = log_path
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()

        args = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--mute-audio",
            "--force-device-scale-factor=1",
            "--window-size=1920,1400",
            f"--user-data-dir={profile_dir}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        # The browser reads commands on fd 3 and writes replies on fd 4; bash puts the pipes there
        # (dash, /bin/sh on Debian, takes one-digit descriptors only).
        wiring = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}'
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["/bin/bash", "-c", wiring, executable, *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(to_browser_r, from_browser_w),
                env={**os.environ, "TZ": "UTC", "LANG": "en_US.UTF-8"},
            )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._out = to_browser_w
        self._in = from_browser_r
        self._buffer = b""
        self._next_id = 0
        self._init_scripts: list[str] = []
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
                "sessionId"
            ]
            self.page("Page.enable")
        except BaseException:
            self.close()
            raise

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def call(self, method: str, session: str | None = None, **params):
        """Send one command and return its result (events that arrive meanwhile are dropped)."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise BrowserGone(
                    f"no answer from Chromium within {self.timeout} s\n{self.log_tail()}"
                )
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise BrowserGone(f"Chromium closed the DevTools pipe\n{self.log_tail()}")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def page(self, method: str, **params):
        return self.call(method, session=self.session, **params)

    def open(
        self, url: str, width: int, height: int, local_storage: dict[str, str] | None = None
    ) -> None:
        """Load `url` in a `width` x `height` viewport, with `local_storage` set before its scripts
        run."""
        for identifier in self._init_scripts:
            self.page("Page.removeScriptToEvaluateOnNewDocument", identifier=identifier)
        self._init_scripts = []
        if local_storage:
            script = "".join(
                f"localStorage.setItem({json.dumps(k)}, {json.dumps(v)});"
                for k, v in local_storage.items()
            )
            self._init_scripts.append(
                self.page("Page.addScriptToEvaluateOnNewDocument", source=script)["identifier"]
            )
        self.page(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.page(
            "Page.navigate", url="about:blank"
        )  # a hash change alone would not reload the app
        self.page("Page.navigate", url=url)

    def evaluate(self, expression: str):
        result = self.page(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise CDPError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, ready, timeout: float = 30.0, interval: float = 0.25):
        """Evaluate `expression` until `ready(value)` holds; return the last value either way.

        A page script that fails meanwhile (say, while the page is still loading) counts as not
        ready.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except BrowserGone:
                raise
            except CDPError:
                value = None
            if ready(value) or time.monotonic() > deadline:
                return value
            time.sleep(interval)

    def screenshot(self, path: Path) -> Path:
        """A PNG of the viewport, taken after the page has painted two more frames."""
        self.evaluate(
            "new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))"
        )
        data = self.page("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.timeout = 5.0
                    self.call("Browser.close")
                except (CDPError, OSError):
                    pass
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            for fd in (self._out, self._in):
                try:
                    os.close(fd)
                except OSError:
                    pass


def write_run(root: Path) -> Path:
    """A real Lightning run of the bundled tiny decoder with the three monitors, logged to
    TensorBoard."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
    from qkmonitor.models import TransformerConfig
    from qkmonitor.models.tasks import AssociativeRecallDataModule, CausalLMTask

    pl.seed_everything(0, verbose=False)
    data = AssociativeRecallDataModule(
        num_pairs=3,
        num_queries=2,
        num_keys=8,
        num_values=8,
        batch_size=8,
        train_size=64,
        val_size=16,
        seed=0,
    )
    config = TransformerConfig(
        vocab_size=data.vocab_size, d_model=32, n_layers=2, n_heads=4, max_seq_len=data.seq_len
    )
    task = CausalLMTask(config, lr=3e-3, warmup_steps=0)
    monitors = [
        QKSpectrumMonitor(every_n_steps=2),
        AttentionEntropyMonitor(every_n_steps=2),
        EffectiveRankMonitor(every_n_steps=2, pattern_heads=2),
    ]
    name, version = RUN_NAME.split("/")
    pl.Trainer(
        default_root_dir=root,
        max_steps=6,
        logger=TensorBoardLogger(root, name, version),
        callbacks=monitors,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    ).fit(task, datamodule=data)
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def tensorboard_ready(url: str) -> bool:
    """True once TensorBoard answers and has loaded the run's layout and heatmaps."""
    try:
        layout = get_json(f"{url}/data/plugin/custom_scalars/layout")
        images = get_json(f"{url}/data/plugin/images/tags")
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return bool(layout.get("category")) and "qkmonitor/heatmap/kappa" in images.get(RUN_NAME, {})


@pytest.fixture(scope="session")
def chromium_executable() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip(
            "headless Chromium not found at /usr/bin/chromium (Debian package `chromium`; "
            ".ci/run installs it)"
        )
    return path


class TensorBoard:
    """A running TensorBoard: its address, and the run it serves as TensorBoard names it."""

    def __init__(self, url: str, run: str = RUN_NAME):
        self.url = url
        self.run = run

    def get_json(self, path: str):
        """One of TensorBoard's data routes, e.g. /data/plugin/images/tags."""
        return get_json(self.url + path)


@pytest.fixture(scope="module")
def tensorboard(chromium_executable, tmp_path_factory):
    """TensorBoard serving a freshly written run on 127.0.0.1, stopped afterwards whatever
    happens."""
    root = tmp_path_factory.mktemp("browser")
    write_run(root / "runs")
    for attempt in range(3):  # the free port may be taken between probing and binding it
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = root / f"tensorboard-{attempt}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                # run from `root` with a relative --logdir: the page shows "runs", as after
                # `qkmonitor train`
                [
                    sys.executable,
                    "-m",
                    "tensorboard.main",
                    "--logdir",
                    "runs",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--load_fast=false",
                    "--reload_interval=0",
                ],
                cwd=root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        try:
            deadline = time.monotonic() + 60
            while (
                proc.poll() is None and time.monotonic() < deadline and not tensorboard_ready(url)
            ):
                time.sleep(0.25)
            if proc.poll() is None and tensorboard_ready(url):
                yield TensorBoard(url)
                return
            if proc.poll() is None:
                pytest.fail(
                    "TensorBoard did not serve the run within 60 "
                    f"s:\n{log_path.read_text()[-3000:]}"
                )
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
    pytest.fail(f"TensorBoard exited before serving, three times:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def browser(chromium_executable, tmp_path_factory):
    root = tmp_path_factory.mktemp("chromium")
    chromium = Chromium(chromium_executable, root / "profile", root / "chromium.log")
    try:
        yield chromium
    finally:
        chromium.close()


@pytest.fixture
def screenshot_dir(tmp_path) -> Path:
    """docs/ with QKMONITOR_UPDATE_SCREENSHOTS=1 (the README embeds them), else the test's
    tmp_path."""
    return REPO / "docs" if UPDATE_SCREENSHOTS else tmp_path

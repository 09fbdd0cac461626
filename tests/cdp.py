"""A headless Chromium driven over the DevTools protocol on a pipe (stdlib only).

`chromium --remote-debugging-pipe` reads protocol commands from file descriptor 3 and writes
replies and events to file descriptor 4, each message JSON terminated by a NUL byte. That is all
the rendered-book test needs to load a page, wait for MathJax, measure it and take a full-page
screenshot, without Selenium or Playwright (whose browsers would have to be downloaded).
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import subprocess
import tempfile
import time


def _above_nine(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class Browser:
    def __init__(self, executable: str, width: int = 1280, height: int = 900):
        self.width, self.height = width, height
        self._profile = tempfile.TemporaryDirectory()
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # Move the child's ends above 9 so that the redirections below cannot overwrite one another.
        to_browser_r, from_browser_w = (_above_nine(fd) for fd in (to_browser_r, from_browser_w))

        # bash (not dash: fds above 9) puts our pipe ends on the child's fds 3 and 4 (dup2 in a preexec_fn would be
        # undone by subprocess closing every fd not listed in pass_fds).
        command = [executable, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                   "--disable-dev-shm-usage", "--no-first-run", "--disable-background-networking",
                   "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                   f"--user-data-dir={self._profile.name}", "about:blank"]
        self._process = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w}', "chromium", *command],
            pass_fds=(to_browser_r, from_browser_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer, self._next_id, self._events = b"", 0, []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    # --- the protocol ----------------------------------------------------------------------------
    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, *, session: bool = False, timeout: float = 60, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    def wait_for_event(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self._events):
                if event.get("method") == method:
                    return self._events.pop(i)
            self._events.append(self._read_message(deadline))

    # --- what the tests use ----------------------------------------------------------------------
    def evaluate(self, expression: str, timeout: float = 60):
        """The value of a JavaScript expression in the page (promises are awaited)."""
        result = self.call("Runtime.evaluate", session=True, timeout=timeout, expression=expression,
                           awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:60]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def open(self, url: str, settle_ms: int = 500) -> None:
        """Load a page and wait until its load event fired and MathJax (if any) finished typesetting."""
        self._events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_for_event("Page.loadEventFired")
        self.evaluate("(window.MathJax && MathJax.startup && MathJax.startup.promise) || null")
        self.evaluate(f"new Promise(done => setTimeout(done, {settle_ms}))")

    def page_height(self) -> int:
        return int(self.evaluate("document.documentElement.scrollHeight"))

    def screenshot(self, path, max_height: int = 16000) -> int:
        """A full-page PNG (scaled down when taller than `max_height` pixels); returns the page height."""
        height = self.page_height()
        scale = min(1.0, max_height / height)
        data = self.call("Page.captureScreenshot", session=True, timeout=120, format="png",
                         captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": self.width, "height": height, "scale": scale})["data"]
        with open(path, "wb") as out:
            out.write(base64.b64decode(data))
        return height

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
        os.close(self._to_browser)
        os.close(self._from_browser)
        self._profile.cleanup()

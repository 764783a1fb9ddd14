"""`python -m lineside` without paying for the interpreter start and the imports on every call: a zygote
process imports lineside.cli and its command modules once (what every `lineside` run does first: main()
imports them to register their commands), then forks one child per command line. Each child is still its own process: it gets its own stdin (/dev/null), stdout and stderr
files, cwd and environment, runs lineside/__main__.py for real and exits through the normal interpreter
shutdown (atexit, finalizers), so its exit status and everything it prints are what a fresh process gives.
Whatever the one import printed is added in front of every result, so noise at import still fails a test.
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Runs in the zygote (python -c CODE REQ ANS): requests come in on fd REQ, answers go out on fd ANS.
_ZYGOTE = r"""
import importlib, json, os, runpy, sys
REQ, ANS = int(sys.argv[1]), int(sys.argv[2])
import lineside, lineside.cli
for name in lineside.cli._COMMAND_MODULES:  # what main() imports before it registers their commands
    importlib.import_module(name)
MAIN = os.path.join(os.path.dirname(lineside.__file__), "__main__.py")
sys.stdout.flush(); sys.stderr.flush()
os.write(ANS, b"ready\n")
requests = os.fdopen(REQ, "rb")
for line in requests:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.write(ANS, b"%d\n" % pid)
        os.write(ANS, b"%d\n" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        continue
    # the child: the command line's own process from here on
    requests.close(); os.close(ANS)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(req["stdout"], os.O_WRONLY | os.O_TRUNC), 1)
    os.dup2(os.open(req["stderr"], os.O_WRONLY | os.O_TRUNC), 2)
    os.chdir(req["cwd"])
    os.environ.clear(); os.environ.update(req["env"])
    sys.path[0] = req["cwd"]  # as for `python -m`: the directory it was started in
    sys.argv = [MAIN, *req["argv"]]
    runpy.run_module("lineside", run_name="__main__", alter_sys=True)
    break  # lineside's main always exits; if it ever returned, exit 0 as `python -m` would
"""

# Variables pytest sets per test; every child gets the caller's value, they do not force a fresh process.
_PER_TEST = {"PYTEST_CURRENT_TEST"}


class Zygote:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="lineside-zygote-"))
        req_r, self._req_w = os.pipe()
        self._ans_r, ans_w = os.pipe()
        self._buf = b""
        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        out, err = self.dir / "import.out", self.dir / "import.err"
        with open(out, "wb") as o, open(err, "wb") as e:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ZYGOTE, str(req_r), str(ans_w)], stdin=subprocess.DEVNULL, stdout=o,
                stderr=e, pass_fds=(req_r, ans_w), env=self.env, cwd=self.cwd)
        os.close(req_r)
        os.close(ans_w)
        self.lock = threading.Lock()
        ready = self._readline(None)
        self.noise_out, self.noise_err = _text(out.read_bytes()), _text(err.read_bytes())
        shutil.rmtree(self.dir)  # the zygote keeps its (now unlinked) import files open; nothing else goes there
        if ready != b"ready\n":
            self.proc.kill()
            raise RuntimeError(f"the CLI zygote did not start: {self.noise_err[-2000:]}")

    def usable_for(self, env: dict[str, str]) -> bool:
        """The zygote imported lineside.cli under its own environment: a different one needs a fresh process."""
        a = {k: v for k, v in env.items() if k not in _PER_TEST}
        b = {k: v for k, v in self.env.items() if k not in _PER_TEST}
        return a == b and self.proc.poll() is None

    def run(self, argv: list[str], *, env: dict[str, str], cwd: str, timeout: float | None,
            ) -> subprocess.CompletedProcess:
        out = tempfile.NamedTemporaryFile(prefix="lineside-cli-", suffix=".out", delete=False)
        err = tempfile.NamedTemporaryFile(prefix="lineside-cli-", suffix=".err", delete=False)
        out.close()
        err.close()
        try:
            req = {"argv": argv, "env": env, "cwd": cwd, "stdout": out.name, "stderr": err.name}
            os.write(self._req_w, (json.dumps(req) + "\n").encode())
            pid = self._int(self._readline(None))
            code = self._wait(pid, timeout)
            stdout = self.noise_out + _text(Path(out.name).read_bytes())
            stderr = self.noise_err + _text(Path(err.name).read_bytes())
            cmd = [sys.executable, "-m", "lineside", *argv]
            if code is None:
                raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
            return subprocess.CompletedProcess(cmd, code, stdout, stderr)
        finally:
            os.unlink(out.name)
            os.unlink(err.name)

    def _wait(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code (negative: killed by that signal), None after killing it at the timeout."""
        line = self._readline(timeout)
        if line is None:
            os.kill(pid, signal.SIGKILL)
            self._readline(None)
            return None
        return self._int(line)

    def _int(self, line: bytes) -> int:
        if not line.strip():
            raise RuntimeError(f"the CLI zygote went away (exit {self.proc.poll()})")
        return int(line)

    def _readline(self, timeout: float | None) -> bytes | None:
        """One line from the zygote, None if none came within timeout (b"" if it went away)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._ans_r], [], [], left)[0]:
                return None
            chunk = os.read(self._ans_r, 4096)
            if not chunk:
                return b""
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line + b"\n"

    def close(self) -> None:
        os.close(self._req_w)  # the zygote reads end of file and exits
        os.close(self._ans_r)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _text(data: bytes) -> str:
    """Decoded as subprocess.run(text=True) decodes (locale encoding, universal newlines)."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


_zygote: Zygote | None = None
_start_lock = threading.Lock()


def shared() -> Zygote:
    global _zygote
    with _start_lock:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = Zygote()
            atexit.register(_zygote.close)
        return _zygote

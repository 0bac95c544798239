"""Starting and stopping a shardd daemon for tests and examples (host backend
unless backend= says otherwise).

    with shardd.daemon.Daemon(devices=4) as d:
        c = shardd.Client(d.socket, job="j", rank=0, world=1)

The binary is `binary`, else $SHARDD_BIN, else the repository's build/shardd
next to this package, else `shardd` on $PATH.
"""
import os
import shutil
import signal
import socket as _socket
import subprocess
import tempfile
import time


def _die_with_parent():
    """In the child: SIGTERM when the process that started it dies (Linux
    PR_SET_PDEATHSIG), so a crashed test or example leaves no daemon behind."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


def find_binary(binary=None):
    if binary:
        return binary
    env = os.environ.get("SHARDD_BIN")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    cand = os.path.normpath(os.path.join(here, "..", "..", "..", "build", "shardd"))
    if os.path.exists(cand):
        return cand
    found = shutil.which("shardd")
    if found:
        return found
    raise FileNotFoundError("shardd binary not found: build it with `make` or set $SHARDD_BIN")


class Daemon:
    """A shardd child process listening on a private socket.

    socket: path to listen on (default: a fresh temporary directory).
    log: a path for the daemon's stdout/stderr (default: <tmpdir>/shardd.log).
    extra_args: further flags (e.g. ["--collective-timeout", "30"]).
    env: variables to set (None: unset) for the daemon on top of os.environ.
    backend: "host" (the default), "cuda" or "auto" (--backend); a cuda daemon
      without a usable GPU exits at start, which raises RuntimeError here.
    """

    def __init__(self, binary=None, socket=None, devices=1, log_level="info", log=None,
                 extra_args=(), ready_timeout=10.0, env=None, backend="host"):
        self.binary = find_binary(binary)
        self._tmpdir = None
        if socket is None:
            self._tmpdir = tempfile.mkdtemp(prefix="shardd-")
            socket = os.path.join(self._tmpdir, "shardd.sock")
        self.socket = socket
        if log is None:
            log = os.path.join(self._tmpdir or os.path.dirname(os.path.abspath(socket)),
                               "shardd.log")
        self.log = log
        self.backend = backend
        # devices None: the daemon's default (cuda: every visible GPU)
        self.args = ([self.binary, "--socket", socket, "--backend", backend]
                     + ([] if devices is None else ["--devices", str(devices)])
                     + ["--log-level", log_level] + list(extra_args))
        self.env = env
        self.proc = None
        self._logf = None
        self.start(ready_timeout)

    def start(self, ready_timeout=10.0):
        self._logf = open(self.log, "ab")
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)
        env.pop("LISTEN_FDS", None)
        for k, v in (self.env or {}).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        self.proc = subprocess.Popen(self.args, stdout=self._logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("shardd exited with %d at start; log %s:\n%s"
                                   % (self.proc.returncode, self.log, self.log_text()[-4000:]))
            if self._connectable():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("shardd did not listen on %s within %.0fs; log %s"
                                   % (self.socket, ready_timeout, self.log))
            time.sleep(0.02)

    def _connectable(self):
        if not os.path.exists(self.socket):
            return False
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            s.connect(self.socket)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def log_text(self):
        try:
            with open(self.log, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout=10.0):
        """SIGTERM, then SIGKILL after timeout. Returns the exit status."""
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            rc = self.proc.returncode
            self.proc = None
        if self._logf is not None:
            self._logf.close()
            self._logf = None
        return rc

    def cleanup(self):
        self.stop()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cleanup()

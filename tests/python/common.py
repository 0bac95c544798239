"""Shared fixtures of the Python tests: paths, one daemon for the run, job names."""
import itertools
import multiprocessing as mp
import os
import queue
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
for p in (os.path.join(REPO, "client", "python"), os.path.join(REPO, "examples"), HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import shardd  # noqa: E402
import shardd.daemon  # noqa: E402

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except Exception:  # not installed, or broken
    HAVE_TORCH = False

try:
    import numpy  # noqa: F401
    HAVE_NUMPY = True
except Exception:
    HAVE_NUMPY = False

# `make check` runs the suite with an ASan-built libshardd preloaded into
# Python (run.py's asan_reexec). Two kinds of test cannot run there: ones
# that measure the process's own memory (ASan's shadow and quarantine are
# in it), and ones where a Python exception crosses torch's C++ (a raise
# inside an autograd hook or __torch_function__): ASan's preloaded runtime
# has no __cxa_throw to intercept (libstdc++ comes later, with torch) and
# aborts the process in its own CHECK. The daemon and the library are the
# ones the normal suite checks; these skip, saying why.
UNDER_ASAN = bool(os.environ.get("SHARDD_PY_ASAN_REEXEC"))
ASAN_MEMORY = "measures the process's memory, which ASan's shadow and quarantine hold too"
ASAN_CXX_THROW = ("a Python exception crosses torch's C++, which aborts under the "
                  "preloaded ASan runtime (no __cxa_throw to intercept)")

DEVICES = 4
_daemon = None
_jobs = itertools.count()


def daemon_env():
    """Environment changes for a daemon the tests start (shardd.daemon.Daemon env=)."""
    env = {}
    if "SHARDD_DAEMON_ASAN_OPTIONS" in os.environ:  # see run.py: asan_reexec
        env["ASAN_OPTIONS"] = os.environ["SHARDD_DAEMON_ASAN_OPTIONS"]
        env["LD_PRELOAD"] = None
    return env


def daemon():
    """The run's daemon (host backend, 4 devices), started on first use."""
    global _daemon
    if _daemon is None:
        _daemon = shardd.daemon.Daemon(devices=DEVICES, log_level="debug",
                                       extra_args=["--collective-timeout", "30"],
                                       env=daemon_env())
    return _daemon


def socket():
    return daemon().socket


def own_daemon(devices=DEVICES, extra_args=()):
    """A daemon of the test's own (host backend), for what is daemon-wide,
    such as the devices' peak bytes: the caller stops it (stop(), cleanup())."""
    return shardd.daemon.Daemon(devices=devices, log_level="debug",
                                extra_args=["--collective-timeout", "30"] + list(extra_args),
                                env=daemon_env())


def stop_daemon():
    """Stops the daemon; -> (exit status, log path) or None when none ran."""
    global _daemon
    if _daemon is None:
        return None
    d, _daemon = _daemon, None
    rc = d.stop()
    log = d.log
    return rc, log, d


def job(tag):
    return "pytest-%d-%s-%d" % (os.getpid(), tag, next(_jobs))


def launch_ranks(target, args_of, world, on_msg, timeout=120):
    """Runs target(*args_of(rank, q)) for every rank as a forkserver process
    (torch and numpy preloaded) and hands each message the ranks put on q
    to on_msg, until every rank has sent ("done", rank). A rank's
    ("error", rank, text), a rank exiting non-zero or the timeout raises
    RuntimeError, after the ranks still running are terminated."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy"])
    q = ctx.Queue()
    procs = [ctx.Process(target=target, name="rank%d" % r, args=args_of(r, q))
             for r in range(world)]
    for p in procs:
        p.start()
    done, error = set(), None
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world and error is None:
            try:
                msg = q.get(timeout=0.5)
            except queue.Empty:
                for p in procs:
                    if p.exitcode not in (None, 0):
                        error = "%s exited with %s" % (p.name, p.exitcode)
                if time.monotonic() > deadline:
                    error = "timed out after %.0fs" % timeout
                continue
            if msg[0] == "done":
                done.add(msg[1])
            elif msg[0] == "error":
                error = "rank %d failed: %s" % (msg[1], msg[2])
            else:
                on_msg(msg)
    finally:
        if error is not None:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join(10)
    if error is not None:
        raise RuntimeError(error)

"""Shared fixtures of the Python tests: paths, one daemon for the run, job names."""
import itertools
import os
import sys

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

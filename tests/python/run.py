#!/usr/bin/env python3
"""Runs the Python tests of shardd (unittest) and prints one closing line

    python: N passed, N failed, N skipped

(scripts/run_tests.sh parses it); exits non-zero on any failure or error.
Starts its own daemon on a temporary socket ($SHARDD_BIN, default
build/shardd; libshardd from $SHARDD_LIB, default build/libshardd.so) and
stops it at the end. Tests needing torch are skipped when it is not
importable. Usage: tests/python/run.py [-v] [test name patterns...]
"""
import os
import subprocess
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# Well past the suite's time (about 300 s on an idle 2-CPU machine, 590 s on a loaded
# one, over 1200 s under ASan/UBSan on a loaded one, `make check`): only a hang trips it.
WATCHDOG_S = float(os.environ.get("SHARDD_PY_TEST_TIMEOUT",
                                  "3600" if os.environ.get("SHARDD_PY_ASAN_REEXEC") else "1500"))


_running = [None, 0.0]  # the test now running and when it began, for the watchdog


class Result(unittest.TextTestResult):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.passed = 0
        self.times = {}
        self._t0 = None

    def startTest(self, test):
        self._t0 = time.monotonic()
        _running[:] = [test.id(), self._t0]
        super().startTest(test)

    def stopTest(self, test):
        self.times[test.id()] = time.monotonic() - self._t0
        super().stopTest(test)

    def addSuccess(self, test):
        self.passed += 1
        super().addSuccess(test)


def watchdog():
    time.sleep(WATCHDOG_S)
    now = ("%s, running for %.0f s" % (_running[0], time.monotonic() - _running[1])
           if _running[0] else "no test started")
    sys.stderr.write("\npython tests: watchdog: still running after %.0fs, giving up (%s)\n"
                     % (WATCHDOG_S, now))
    sys.stderr.flush()
    print("python: 0 passed, 1 failed, 0 skipped", flush=True)
    os._exit(2)


def asan_reexec():
    """`make check` hands us an ASan/UBSan-built libshardd. Python itself is
    not instrumented, so the ASan runtime must be preloaded for ctypes to load
    the library: re-exec once with LD_PRELOAD set. Leak detection is off for
    the Python processes (the interpreter's own allocations are not ours);
    the daemon gets the caller's ASAN_OPTIONS back (common.daemon)."""
    if os.environ.get("SHARDD_PY_ASAN_REEXEC"):
        return
    lib = os.environ.get("SHARDD_LIB") or os.path.join(
        os.path.dirname(os.path.dirname(HERE)), "build", "libshardd.so")
    try:
        out = subprocess.run(["ldd", lib], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return
    rt = [ln.split("=>")[1].split()[0] for ln in out.splitlines()
          if "libasan.so" in ln and "=>" in ln]
    if not rt:
        return
    env = dict(os.environ)
    env["SHARDD_PY_ASAN_REEXEC"] = "1"
    env["SHARDD_DAEMON_ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "")
    env["ASAN_OPTIONS"] = ":".join(x for x in (env.get("ASAN_OPTIONS", ""), "detect_leaks=0") if x)
    env["LD_PRELOAD"] = " ".join(x for x in (rt[0], env.get("LD_PRELOAD", "")) if x)
    print("python tests: %s is ASan-instrumented; re-running with LD_PRELOAD=%s" % (lib, rt[0]),
          flush=True)
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env)


def main(argv):
    asan_reexec()
    verbosity = 2 if "-v" in argv else 1
    patterns = [a for a in argv if not a.startswith("-")]
    threading.Thread(target=watchdog, daemon=True).start()
    t0 = time.monotonic()
    loader = unittest.TestLoader()
    if patterns:
        loader.testNamePatterns = ["*%s*" % p for p in patterns]
    failed_setup = 0
    try:
        import common
        suite = loader.discover(HERE, pattern="test_*.py", top_level_dir=HERE)
    except Exception as e:  # e.g. libshardd not found
        import traceback
        traceback.print_exc()
        print("python tests: cannot load: %s" % e)
        print("python: 0 passed, 1 failed, 0 skipped")
        return 1
    runner = unittest.TextTestRunner(stream=sys.stdout, verbosity=verbosity, resultclass=Result)
    res = runner.run(suite)
    st = common.stop_daemon()
    if st is not None:
        rc, log, d = st
        if rc != 0:
            print("python tests: the daemon exited with status %s on SIGTERM; log %s:\n%s"
                  % (rc, log, d.log_text()[-3000:]))
            failed_setup += 1
        d.cleanup()
    slow = sorted(res.times.items(), key=lambda kv: -kv[1])[:5]
    print("slowest: " + ", ".join("%s %.1fs" % (k.split(".", 1)[-1], v) for k, v in slow))
    print("python tests: %.1fs" % (time.monotonic() - t0))
    failed = len(res.failures) + len(res.errors) + len(res.unexpectedSuccesses) + failed_setup
    print("python: %d passed, %d failed, %d skipped" % (res.passed, failed, len(res.skipped)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

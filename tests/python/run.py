#!/usr/bin/env python3
"""Runs the Python tests of shardd (unittest) and prints one closing line

    python: N passed, N failed, N skipped

(scripts/run_tests.sh parses it); exits non-zero on any failure or error.
Runs the test modules SHARDD_PY_JOBS at a time (default 2: most of a
test's time is spent waiting on its rank processes and the daemon), each
group of modules in a worker process of its own (run.py --worker) with its
own daemon on a temporary socket ($SHARDD_BIN, default build/shardd;
libshardd from $SHARDD_LIB, default build/libshardd.so), stopped at the
end; a module's output is printed whole once it has finished. Tests
needing torch are skipped when it is not importable.
Usage: tests/python/run.py [-v] [test name patterns...]
"""
import json
import os
import selectors
import subprocess
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# Well past the suite's time (about 300 s on an idle 2-CPU machine one module at a
# time, 590 s on a loaded one, over 1200 s under ASan/UBSan on a loaded one, `make
# check`): only a hang trips it.
WATCHDOG_S = float(os.environ.get("SHARDD_PY_TEST_TIMEOUT",
                                  "3600" if os.environ.get("SHARDD_PY_ASAN_REEXEC") else "1500"))
JOBS = max(1, int(os.environ.get("SHARDD_PY_JOBS", "2")))
# A worker's line saying a module (or, with "module": null, the worker) is done.
MARK = "\x1eshardd-run-py "
# Modules that take longest go first, so that no long one is left to run
# alone at the end (each took over 20 s, one at a time on a loaded 2-CPU
# machine); the rest follow in name order.
SLOW_FIRST = ["test_builtin_modules", "test_daemon_restart", "test_two_forwards", "test_fsdp",
              "test_torch_optim", "test_memory_bound", "test_unit_backward_end", "test_rejoin",
              "test_train_gpt"]


# Some tests start ranks in a directory of their own (the README's quick
# start, as a user runs it): paths given relative to the checkout must hold
# there too (`make check` passes build/check/libshardd.so).
for _k in ("SHARDD_LIB", "SHARDD_BIN", "SHARDCTL_BIN"):
    if os.environ.get(_k) and not os.path.isabs(os.environ[_k]):
        os.environ[_k] = os.path.abspath(os.environ[_k])

_running = [None, 0.0]  # the test now running and when it began, for the watchdog
_workers = []  # the parent's worker processes, which its watchdog ends


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


def watchdog(after_s):
    time.sleep(after_s)
    now = ("%s, running for %.0f s" % (_running[0], time.monotonic() - _running[1])
           if _running[0] else "no test started")
    sys.stderr.write("\npython tests: watchdog: still running after %.0fs, giving up (%s)\n"
                     % (after_s, now))
    sys.stderr.flush()
    for w in _workers:
        w.kill()
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


def loader_for(patterns):
    loader = unittest.TestLoader()
    if patterns:
        loader.testNamePatterns = ["*%s*" % p for p in patterns]
    return loader


def stop_run_daemon():
    """Stops this process's daemon; -> the number of failures it makes (1
    when it did not exit 0 on SIGTERM, printing its log's tail)."""
    import common
    st = common.stop_daemon()
    if st is None:
        return 0
    rc, log, d = st
    bad = 0
    if rc != 0:
        print("python tests: the daemon exited with status %s on SIGTERM; log %s:\n%s"
              % (rc, log, d.log_text()[-3000:]))
        bad = 1
    d.cleanup()
    return bad


def counts(res):
    return {"passed": res.passed, "skipped": len(res.skipped), "times": res.times,
            "failed": len(res.failures) + len(res.errors) + len(res.unexpectedSuccesses)}


def worker(verbosity, patterns):
    """run.py --worker: runs each module named on a line of stdin, then a
    MARK line of its counts; at EOF stops its daemon and says so the same
    way (module null)."""
    loader = loader_for(patterns)
    runner = unittest.TextTestRunner(stream=sys.stdout, verbosity=verbosity, resultclass=Result)
    for line in sys.stdin:
        name = line.strip()
        try:
            suite = loader.loadTestsFromName(name)
        except Exception as e:
            print("python tests: cannot load %s: %s" % (name, e))
            out = {"passed": 0, "failed": 1, "skipped": 0, "times": {}}
        else:  # (a module no pattern picks from says nothing)
            out = (counts(runner.run(suite)) if suite.countTestCases() else
                   {"passed": 0, "failed": 0, "skipped": 0, "times": {}, "quiet": True})
        out["module"] = name
        sys.stderr.flush()
        print(MARK + json.dumps(out), flush=True)
    bad = stop_run_daemon()
    sys.stderr.flush()
    print(MARK + json.dumps({"module": None, "passed": 0, "failed": bad, "skipped": 0,
                             "times": {}}), flush=True)
    return 0


def modules():
    names = sorted(f[:-3] for f in os.listdir(HERE) if f.startswith("test_") and f.endswith(".py"))
    return [m for m in SLOW_FIRST if m in names] + [m for m in names if m not in SLOW_FIRST]


def run_workers(argv, todo):
    """Feeds the modules todo to JOBS workers, one at a time each as it
    finishes the last; prints each module's output once it is done. ->
    {passed, failed, skipped, times} summed."""
    total = {"passed": 0, "failed": 0, "skipped": 0, "times": {}}
    sel = selectors.DefaultSelector()
    todo = list(todo)
    for _ in range(min(JOBS, len(todo)) or 1):
        w = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"] + argv,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, bufsize=0)
        w.held, w.module, w.finished = b"", None, False
        _workers.append(w)
        sel.register(w.stdout, selectors.EVENT_READ, w)
        give(w, todo)
    while sel.get_map():
        for key, _ in sel.select():
            w = key.data
            data = os.read(w.stdout.fileno(), 65536)
            if not data:  # the worker is gone
                sel.unregister(w.stdout)
                rc = w.wait()
                if not w.finished:
                    sys.stdout.write(w.held.decode(errors="replace"))
                    print("python tests: a worker exited with status %s running %s"
                          % (rc, w.module))
                    total["failed"] += 1
                continue
            w.held += data
            while True:
                at = w.held.find(MARK.encode())
                end = w.held.find(b"\n", at)
                if at < 0 or end < 0:
                    break
                out = json.loads(w.held[at + len(MARK):end])
                if out["module"] is not None and not out.get("quiet"):
                    sys.stdout.write("-- %s\n" % out["module"])
                sys.stdout.write(w.held[:at].decode(errors="replace"))
                sys.stdout.flush()
                w.held = w.held[end + 1:]
                for k in ("passed", "failed", "skipped"):
                    total[k] += out[k]
                total["times"].update(out["times"])
                if out["module"] is None:
                    w.finished = True
                else:
                    give(w, todo)
    if todo:  # every worker died
        print("python tests: not run, no worker left: %s" % " ".join(todo))
        total["failed"] += 1
    return total


def give(w, todo):
    """The next module to worker w, or EOF when none is left."""
    if todo:
        w.module = todo.pop(0)
        w.stdin.write((w.module + "\n").encode())
        w.stdin.flush()
    else:
        w.module = None
        w.stdin.close()


def main(argv):
    asan_reexec()
    verbosity = 2 if "-v" in argv else 1
    patterns = [a for a in argv if not a.startswith("-")]
    if "--worker" in argv:
        threading.Thread(target=watchdog, args=(WATCHDOG_S,), daemon=True).start()
        return worker(verbosity, patterns)
    # a worker's own watchdog names the test that hangs; this one is the backstop
    threading.Thread(target=watchdog, args=(WATCHDOG_S + 60,), daemon=True).start()
    t0 = time.monotonic()
    try:
        __import__("common")
    except Exception as e:  # e.g. libshardd not found
        import traceback
        traceback.print_exc()
        print("python tests: cannot load: %s" % e)
        print("python: 0 passed, 1 failed, 0 skipped")
        return 1
    total = run_workers([a for a in argv if a != "--worker"], modules())
    slow = sorted(total["times"].items(), key=lambda kv: -kv[1])[:5]
    print("slowest: " + ", ".join("%s %.1fs" % (k.split(".", 1)[-1], v) for k, v in slow))
    print("python tests: %.1fs (%d at a time)" % (time.monotonic() - t0, JOBS))
    print("python: %d passed, %d failed, %d skipped"
          % (total["passed"], total["failed"], total["skipped"]))
    return 1 if total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

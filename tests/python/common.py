"""Shared fixtures of the Python tests: paths, one daemon for the run, job
names, rank processes and the training loop they report from."""
import contextlib
import itertools
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import time
import traceback

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
ASAN_TORCH_THROW = ("torch answers a question (queue_callback outside a backward) by a "
                    "C++ throw, which aborts under the preloaded ASan runtime")

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


def rank_failed(rank, q, e):
    """In a launch_ranks rank, inside `except BaseException as e:`: puts
    ("error", rank, the error and its traceback) on q and ends the rank
    with exit code 1."""
    q.put(("error", rank, "%s\n%s" % (e, traceback.format_exc())))
    raise SystemExit(1)


# ---- training ranks that report to their parent -------------------------
# A relaunched training script is the same script: the rank side is
# train_loop inside reported(); the parent's side is Ranks, which reads what
# they report.


@contextlib.contextmanager
def reported(rank, q):
    """In a rank process: a failure of the block is put on q as ("error",
    rank, code name or exception type, message) and ends the rank."""
    try:
        yield
    except shardd.Error as e:
        q.put(("error", rank, e.code_name, e.message))
    except BaseException as e:
        q.put(("error", rank, type(e).__name__, "%s\n%s" % (e, traceback.format_exc())))


def fake_trial_clock(sm, cost, cpus=1 << 12):
    """Gives sm (a ShardedModule with prefetch="auto") a clock under which
    each step of its trial takes cost[mode] ({"on": s, "off": s}; a list:
    each step of that mode its own in turn), so that the trial's choice is
    known, and cpus CPUs (by default more than any node's ranks and
    threads: the trial runs; see ShardedModule._spare_cpu)."""
    t = [0.0]
    left = {m: list(c) for m, c in cost.items() if isinstance(c, (list, tuple))}

    def clock():
        tr = sm._trial
        if tr is not None and tr["mode"] is not None:
            m = tr["mode"]  # the step since the last forward
            t[0] += left[m].pop(0) if m in left else cost[m]
        return t[0]

    sm._clock = clock
    sm._cpus = lambda: cpus


def last_params(target, args_of, world, timeout=60):
    """launch_ranks, returning the last ("params", {name: array}) message
    a rank sent (rank 0's full parameters at the end), None if none came."""
    out = []
    launch_ranks(target, args_of, world,
                 lambda msg: out.append(msg[1]) if msg[0] == "params" else None, timeout)
    return out[-1] if out else None


def launch_collect(target, args_of, world, timeout=120):
    """launch_ranks, returning what the ranks put on q: got["params"] the
    last ("params", {name: array}), got[(kind, rank)] the third item of
    every other (kind, rank, value) message."""
    got = {}

    def on_msg(m):
        if m[0] == "params":
            got["params"] = m[1]
        else:
            got[(m[0], m[1])] = m[2]

    launch_ranks(target, args_of, world, on_msg, timeout)
    return got


def run_processes(argvs, cwd, env, timeout=300):
    """Starts a process per argv at once (as a user starts one per rank)
    and waits for all: -> [(returncode, stdout, stderr)]. A timeout kills
    every one and raises."""
    procs = [subprocess.Popen(a, cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a in argvs]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs


def max_rel(got, want):
    """max |got - want| over max |want| of one tensor (float64)."""
    import numpy as np
    d = np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want, dtype=np.float64))
    return float(d.max() / max(np.abs(np.asarray(want, dtype=np.float64)).max(), 1e-30))


def train_loop(rank, q, steps, client, sm, opt, step, pause_s=0.0):
    """In a rank process: the loop of a training script relaunched
    unchanged. It goes on from the daemon's step count (opt.steps) to steps,
    step(s) running step s and giving its loss, and sleeps pause_s after
    each (room for the parent's kill between steps); then closes client.
    Reports ("start", rank, first step), ("loss", rank, s, loss) for each
    step, rank 0's ("params", {name: array}) and ("done", rank)."""
    start = opt.steps
    q.put(("start", rank, start))
    for s in range(start, steps):
        q.put(("loss", rank, s, step(s)))
        time.sleep(pause_s)
    send_params(rank, q, sm)
    client.close()
    q.put(("done", rank))


def send_params(rank, q, sm):
    """In a rank process, on every rank (sm.full_parameters() gathers):
    rank 0 puts ("params", {name: array}) of the whole parameters on q,
    as last_params and the tests' comparisons with torch read them."""
    params = sm.full_parameters()
    if rank == 0:
        q.put(("params", {n: t.numpy().copy() for n, t in params.items()}))


class Ranks:
    """world rank processes of target(*args_of(rank, q), **kwargs)
    (forkserver, torch and numpy preloaded), started at once, and what they
    report as train_loop and reported() do: starts {rank: step}, losses
    {step: {rank: loss}}, rank 0's params, done {rank}, errors [(rank,
    what, message)]."""

    def __init__(self, target, args_of, world, kwargs=None, timeout=90):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "numpy"])
        self.q = ctx.Queue()
        self.world = world
        self.timeout = timeout
        self.procs = [ctx.Process(target=target, args=args_of(r, self.q), kwargs=kwargs or {})
                      for r in range(world)]
        self.starts, self.losses, self.errors, self.done = {}, {}, [], set()
        self.params = None
        for p in self.procs:
            p.start()

    def poll(self, until, timeout=None):
        """Reads reports until until(self) holds; RuntimeError after timeout
        (the one given at creation by default)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not until(self):
            if time.monotonic() > deadline:
                raise RuntimeError("timed out; errors %s" % self.errors)
            try:
                msg = self.q.get(timeout=0.2)
            except queue.Empty:
                continue
            if msg[0] == "start":
                self.starts[msg[1]] = msg[2]
            elif msg[0] == "loss":
                self.losses.setdefault(msg[2], {})[msg[1]] = msg[3]
            elif msg[0] == "params":
                self.params = msg[1]
            elif msg[0] == "done":
                self.done.add(msg[1])
            else:
                self.errors.append(msg[1:])

    def finish(self, timeout=None):
        """Waits for every rank to be done or failed; returns self."""
        self.poll(lambda s: len(s.done) + len(s.errors) >= s.world, timeout)
        for p in self.procs:
            p.join(10)
        return self

    def kill(self):
        """SIGKILLs every rank still running."""
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.join(10)

    def mean_losses(self):
        """{step: the ranks' mean loss} for the steps every rank reported."""
        return {s: sum(v.values()) / len(v) for s, v in self.losses.items()
                if len(v) == self.world}

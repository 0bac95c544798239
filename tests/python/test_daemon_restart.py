"""A daemon restart loses nothing: the daemon runs under a minimal service
manager that speaks systemd's real protocol (a notify socket receiving
READY=1 and FDSTORE=1/FDSTOREREMOVE=1 datagrams with their descriptors in
SCM_RIGHTS; on a restart every stored descriptor handed back at fd 3 on
with LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID, the socket unit's listener
first), started with the ExecStart flags of systemd/shardd.service.in.
Two ranks train the GPT shape; the daemon is SIGKILLed between steps,
restarted, the trainers relaunched: they resume at the step reached and
the run equals an uninterrupted one bit for bit, through two such kills
(the second after a restart from the store never resumes older). Killed
inside a step, the job is torn: every attach is refused naming the step,
until it is released."""
import array
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest

import common
import shardd
import shardd.daemon

if common.HAVE_TORCH:
    import numpy as np
    import torch
    import shardd.nn
    import shardd.optim
    import models

STEPS = 8
UNIT = os.path.join(common.REPO, "systemd", "shardd.service.in")


def exec_start_flags(state_dir):
    """The unit's ExecStart arguments after the binary, its state directory
    (/var/lib/shardd) made state_dir."""
    with open(UNIT) as f:
        line = next(l for l in f if l.startswith("ExecStart="))
    argv = shlex.split(line[len("ExecStart="):])
    assert argv[0].endswith("/shardd"), argv
    return [a.replace("/var/lib/shardd", state_dir) for a in argv[1:]]


class Manager:
    """The service manager's side: notify socket, fd store, start with
    socket activation and the stored fds, SIGKILL."""

    def __init__(self, root):
        self.root = root
        self.notify_path = os.path.join(root, "notify")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(self.notify_path)
        self.notify.settimeout(0.05)
        # the socket unit's listener, passed at every start
        self.sock_path = os.path.join(root, "shardd.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.sock_path)
        self.listener.listen(64)
        self.store = {}  # FDNAME -> our descriptor
        self.stored_total = self.removed_total = 0
        self.proc = None
        self.ready = False
        self.log = os.path.join(root, "daemon.log")
        # as systemd, it reads the notify socket all the time: a daemon
        # sending into a full socket waits
        self.lock = threading.Lock()
        self.closing = False
        self.reader = threading.Thread(target=self.read_loop, daemon=True)
        self.reader.start()

    def read_loop(self):
        while not self.closing:
            self.pump()
            time.sleep(0.01)

    def pump(self):
        with self.lock:
            self.pump_locked()

    def pump_locked(self):
        while True:
            try:
                msg, anc, _, _ = self.notify.recvmsg(
                    4096, socket.CMSG_SPACE(64 * 4), socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, socket.timeout):
                return
            fds = []
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(data[:len(data) - len(data) % a.itemsize])
                    fds.extend(a)
            fields = dict(l.split("=", 1) for l in msg.decode().split("\n") if "=" in l)
            if fields.get("FDSTORE") == "1":
                name = fields.get("FDNAME", "stored")
                for fd in fds:
                    old = self.store.pop(name, None)
                    if old is not None:
                        os.close(old)
                    self.store[name] = fd
                    self.stored_total += 1
                continue
            for fd in fds:
                os.close(fd)
            if fields.get("FDSTOREREMOVE") == "1":
                old = self.store.pop(fields.get("FDNAME"), None)
                if old is not None:
                    os.close(old)
                    self.removed_total += 1
            if fields.get("READY") == "1":
                self.ready = True

    def start(self, extra=()):
        assert self.proc is None
        self.pump()
        with self.lock:  # dups: the reader may close a removed one meanwhile
            names = ["shardd.socket"] + sorted(self.store)
            fds = [os.dup(self.listener.fileno())] + [os.dup(self.store[n])
                                                      for n in names[1:]]
        flags = exec_start_flags(os.path.join(self.root, "state"))
        argv = [shardd.daemon.find_binary()] + flags + [
            "--devices", "2", "--log-level", "debug"] + list(extra)
        env = dict(os.environ, NOTIFY_SOCKET=self.notify_path, FDSTORE="65536",
                   LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=":".join(names))
        for k, v in common.daemon_env().items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v

        def place_fds():  # fd 3 on, in order, inheritable
            hi = [os.dup(fd) for fd in fds]
            high = []
            for h in hi:  # above every target before any dup2 onto one
                import fcntl
                high.append(fcntl.fcntl(h, fcntl.F_DUPFD, 3 + len(fds) + 64))
                os.close(h)
            for i, h in enumerate(high):
                os.dup2(h, 3 + i, inheritable=True)
                os.close(h)

        self.ready = False
        logf = open(self.log, "a")
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh"] + argv,
            env=env, stdout=logf, stderr=logf, close_fds=False,
            preexec_fn=place_fds)
        logf.close()
        for fd in fds:
            os.close(fd)
        deadline = time.monotonic() + 30
        while not self.ready:
            if self.proc.poll() is not None:
                raise RuntimeError("daemon exited %s; log:\n%s"
                                   % (self.proc.returncode, self.read_log()))
            if time.monotonic() > deadline:
                raise RuntimeError("no READY=1; log:\n" + self.read_log())
            time.sleep(0.02)

    def wait_journal_record(self, timeout):
        """Waits until a job's step journal (its "-j" memfd, read through
        the store's descriptor) holds a step in progress: -> (step,
        optimizer name). Layout (daemon/fdstore.c): magic[8], overflow
        u64, then records of a u64 step + 1 and a 112-byte name."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                pages = [os.pread(fd, 4096, 0) for n, fd in self.store.items()
                         if n.startswith("shardd-m") and n.endswith("-j")]
            for page in pages:
                if page[:8] != b"SHDJRNL1":
                    continue
                for off in range(16, 16 + 31 * 120, 120):
                    step1 = int.from_bytes(page[off:off + 8], "little")
                    if step1:
                        name = page[off + 8:off + 120].split(b"\0")[0].decode()
                        return step1 - 1, name
            time.sleep(0.01)
        raise RuntimeError("no step in progress in any journal")

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None
        self.pump()

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None
        self.pump()

    def close(self):
        if self.closing:
            return
        self.stop()
        self.closing = True
        log = self.read_log() if os.path.exists(self.log) else ""
        if "Sanitizer" in log:  # a sanitizer build's report (make check)
            raise AssertionError("the daemon's log holds a sanitizer report:\n" + log[-8000:])
        self.reader.join(5)
        for fd in self.store.values():
            os.close(fd)
        self.store.clear()
        self.notify.close()
        self.listener.close()

    def read_log(self):
        with open(self.log, errors="replace") as f:
            return f.read()


def trainer(rank, world, sock, job, q, pause_s=0.0):
    """The GPT recipe's loop, relaunched unchanged: it goes on from the
    daemon's step count."""
    with common.reported(rank, q):
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world,
                               transient_areas=True)
        cfg = models.GPTConfig()
        model = models.nano_gpt(cfg)
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
        opt = shardd.optim.AdamW(model.parameters(), lr=1e-2, name="adamw")

        def step(s):
            opt.zero_grad()
            x, y = models.gpt_batch(cfg, s, rank, world)
            loss = models.gpt_loss(model, x, y)
            loss.backward()
            opt.step()
            return loss.item()

        common.train_loop(rank, q, STEPS, client, sm, opt, step, pause_s)


class Run(common.Ranks):
    """world (2) trainer processes."""

    def __init__(self, sock, job, pause_s=0.0, world=2):
        super().__init__(trainer, lambda r, q: (r, world, sock, job, q, pause_s), world,
                         timeout=120)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class DaemonRestartTest(unittest.TestCase):
    _ref = None

    def manager(self):
        root = tempfile.mkdtemp(prefix="shardd-fdstore-")
        self.addCleanup(shutil.rmtree, root, True)
        os.mkdir(os.path.join(root, "state"), 0o750)
        m = Manager(root)
        self.addCleanup(m.close)
        return m

    def reference(self):
        if DaemonRestartTest._ref is None:
            m = self.manager()
            m.start()
            run = Run(m.sock_path, common.job("restart-ref")).finish()
            self.assertEqual(run.errors, [])
            DaemonRestartTest._ref = run
        return DaemonRestartTest._ref

    def assert_continues(self, run, ref, start):
        want = ref.mean_losses()
        got = run.mean_losses()
        self.assertEqual(sorted(got), list(range(start, STEPS)))
        for s, v in got.items():
            self.assertEqual(v, want[s], "step %d's loss" % s)
        self.assertEqual(sorted(run.params), sorted(ref.params))
        for n, v in ref.params.items():
            np.testing.assert_array_equal(run.params[n], v, err_msg=n)

    def kill_between_steps(self, m, run, after):
        """Waits for every rank to finish step `after`, then SIGKILLs the
        daemon and the trainers (which lost it)."""
        run.poll(lambda s: len(s.losses.get(after, {})) == 2)
        m.kill()
        run.kill()
        return max(s for s, v in run.losses.items() if len(v) == 2) + 1

    def test_sigkill_between_steps_twice_resumes_bit_identical(self):
        ref = self.reference()
        m = self.manager()
        m.start()
        job = common.job("restart")
        first = Run(m.sock_path, job, pause_s=0.3)
        reached = self.kill_between_steps(m, first, 2)
        self.assertEqual(first.errors, [])
        self.assertGreater(len(m.store), 3, "regions and description stored")
        # the units of a rank were registered in one batch: their blocks
        # are adopted from shared files (slabs), not a memfd each
        files = [f for _, f, _ in self.slab_lines(m)]
        self.assertGreater(len(files), len(set(files)), "blocks sharing a file")
        m.start()
        log = m.read_log()
        self.assertIn("resumed from the fd store at step %d" % reached, log)
        second = Run(m.sock_path, job, pause_s=0.3)
        second.poll(lambda s: len(s.starts) == 2)
        self.assertEqual(set(second.starts.values()), {reached})
        # a second kill after a restart from the store: never older
        reached2 = self.kill_between_steps(m, second, reached + 2)
        self.assertGreaterEqual(reached2, reached + 3)
        m.start()
        third = Run(m.sock_path, job).finish()
        self.assertEqual(third.errors, [])
        self.assertEqual(set(third.starts.values()), {reached2})
        print("\n  SIGKILL of the daemon after steps %d and %d: resumed at %d "
              "and %d from the fd store (%d descriptors stored)"
              % (reached - 1, reached2 - 1, reached, reached2, m.stored_total))
        self.assert_continues(third, ref, reached2)
        # the first and second runs' steps equal the reference too
        for run in (first, second):
            for s, v in run.mean_losses().items():
                self.assertEqual(v, ref.mean_losses()[s], "step %d's loss" % s)

    def slab_lines(self, m):
        """The description's region lines of blocks in slabs: [(buffer,
        FDNAME, offset)], from the newest whole slot of any job."""
        best = (0, [])
        with m.lock:
            for n, fd in m.store.items():
                if n.startswith("shardd-m") and n[-2:] in ("-a", "-b"):
                    gen = int.from_bytes(os.pread(fd, 16, 0)[8:16], "little")
                    text = os.pread(fd, 1 << 20, 4096).decode(errors="replace")
                    lines = re.findall(r"^region buffer (\S+) \d+ (\S+) (\d+)$", text, re.M)
                    if gen > best[0]:
                        best = (gen, [(b, f, int(o)) for b, f, o in lines])
        return best[1]

    def test_a_batch_s_slab_with_a_buffer_freed_is_adopted_with_the_others_bytes(self):
        """Buffers registered in one batch share one memfd per rank (a
        slab); one of them freed before a SIGKILL leaves a hole in it. The
        restart adopts the slab for the others, every byte as it was, and
        the freed one stays gone (registered again: fresh zeros)."""
        m = self.manager()
        m.start()
        job = common.job("restart-slab")
        sizes = [1000 + 700 * i for i in range(4)]
        c = shardd.Client(m.sock_path, job=job, rank=0, world=1)
        bufs = c.register_buffers([("s%d" % i, "fp32", n) for i, n in enumerate(sizes)])

        def values(i):
            return np.arange(sizes[i], dtype=np.float32) * 3 + 1000 * i

        for i, b in enumerate(bufs):
            b.numpy("shard")[:] = values(i)
        c.unregister_buffer(bufs[1])
        deadline = time.monotonic() + 10
        while len(self.slab_lines(m)) != 3 and time.monotonic() < deadline:
            c.ping()  # the description is rewritten as the loop goes idle
            time.sleep(0.02)
        lines = self.slab_lines(m)
        self.assertEqual(sorted(b for b, _, _ in lines), ["s0", "s2", "s3"])
        self.assertEqual(len({f for _, f, _ in lines}), 1, "one file for the batch")
        m.kill()
        c.close()
        m.start()
        c = shardd.Client(m.sock_path, job=job, rank=0, world=1)
        kept = c.register_buffers([("s%d" % i, "fp32", sizes[i]) for i in (0, 2, 3)])
        for i, b in zip((0, 2, 3), kept):
            self.assertFalse(b.created)
            np.testing.assert_array_equal(b.numpy("shard"), values(i), err_msg="s%d" % i)
        gone = c.register_buffers([("s1", "fp32", sizes[1])])[0]
        self.assertTrue(gone.created)
        self.assertFalse(gone.numpy("shard").any())
        c.close()

    def test_stop_and_start_resumes_from_the_store_before_the_exit_checkpoint(self):
        """A clean stop (SIGTERM) writes the exit checkpoint and leaves the
        store as it is; the start resumes from the store and says the exit
        checkpoint of that job was not restored."""
        ref = self.reference()
        m = self.manager()
        m.start()
        job = common.job("restart-stop")
        first = Run(m.sock_path, job, pause_s=0.3)
        first.poll(lambda s: len(s.losses.get(2, {})) == 2)
        m.stop()
        first.kill()
        reached = max(s for s, v in first.losses.items() if len(v) == 2) + 1
        exit_dir = os.path.join(m.root, "state", "exit", job)
        self.assertTrue(os.path.exists(os.path.join(exit_dir, "manifest")))
        m.start()
        log = m.read_log()
        self.assertIn("job \"%s\" resumed from the fd store at step %d" % (job, reached), log)
        self.assertIn("--restore: job \"%s\" in %s not restored: the fd store held it"
                      % (job, exit_dir), log)
        again = Run(m.sock_path, job).finish()
        self.assertEqual(again.errors, [])
        self.assertEqual(set(again.starts.values()), {reached})
        self.assert_continues(again, ref, reached)
        # stepped past it: a start without the store (a reboot) must not
        # bring the exit checkpoint back in silence
        self.assertTrue(os.path.exists(os.path.join(exit_dir, "superseded")),
                        m.read_log())

    def test_a_job_restored_by_an_operator_is_kept_before_any_rank_attaches(self):
        """shardctl restore makes a job no rank has touched yet: it is in
        the store once its files are loaded, so a SIGKILL right after
        loses nothing."""
        m = self.manager()
        m.start()
        job = common.job("restart-restored")
        first = Run(m.sock_path, job, pause_s=0.3)
        first.poll(lambda s: len(s.losses.get(1, {})) == 2)
        first.kill()
        ckpt = os.path.join(m.root, "state", "ck")
        ctl = shardd.Client(m.sock_path)
        ctl.checkpoint(ckpt, job=job, timeout=10)
        ctl.release_job(job)
        self.assertEqual(ctl.restore(ckpt), job)
        ctl.close()
        log = m.read_log()
        step = int(log.split("restored from %s at step " % ckpt)[1].split()[0])
        time.sleep(0.3)
        m.kill()
        m.start()
        self.assertIn("job \"%s\" resumed from the fd store at step %d" % (job, step),
                      m.read_log())

    def test_sigkill_at_random_instants_never_resumes_half_a_step(self):
        """SIGKILL at random instants of a run without pauses (between
        steps, inside one, in a gather or scatter), several times: each
        relaunch either resumes and ends bit-identical to the uninterrupted
        run, or is refused as torn naming the step the kill landed in."""
        ref = self.reference()
        rnd = random.Random(int(os.environ.get("SHARDD_TEST_SEED", "32")))
        outcomes = []
        for trial in range(4):
            m = self.manager()
            m.start()
            job = common.job("restart-rnd")
            first = Run(m.sock_path, job)
            k = rnd.randrange(0, 5)
            first.poll(lambda s: len(s.losses.get(k, {})) == 2)
            # a step takes 10-100 ms (idle or loaded machine): the kill lands
            # in the next step or two, not after the run
            time.sleep(rnd.uniform(0.0, 0.03))
            m.kill()
            first.kill()
            done = max((s for s, v in first.losses.items() if len(v) == 2), default=-1) + 1
            # on a fast machine the kill may land after the run ended: its
            # ranks finished (Goodbye), the job was released, and a rerun
            # rightly starts a fresh job at step 0
            finished = ("job \"%s\" released (every rank finished)" % job) in m.read_log()
            m.start()
            again = Run(m.sock_path, job).finish()
            if finished:
                self.assertFalse(again.errors, again.errors)
                self.assertEqual(set(again.starts.values()), {0}, m.read_log())
                self.assert_continues(again, ref, 0)
                outcomes.append("finished before the kill, fresh at 0")
                m.close()
                continue
            if again.errors:
                codes = {e[1] for e in again.errors}
                self.assertEqual(codes, {"E_STATE"}, again.errors)
                msg = again.errors[0][2]
                self.assertIn("torn", msg)
                step = int(msg.split("during step ")[1].split()[0])
                # the step in progress: past every one the ranks saw end
                self.assertGreaterEqual(step, done + 1, msg)
                outcomes.append("torn in step %d" % step)
            else:
                start = set(again.starts.values())
                self.assertEqual(len(start), 1)
                start = start.pop()
                # at least what the ranks saw end (a loss in their queue
                # may not have reached us before the kill)
                self.assertGreaterEqual(start, done, m.read_log())
                self.assert_continues(again, ref, start)
                outcomes.append("resumed at %d" % start)
            m.close()
        print("\n  random SIGKILLs: %s" % ", ".join(outcomes))

    def test_a_description_naming_memory_not_handed_back_is_refused(self):
        """A region the description names is missing from the store (a
        kill between a buffer's free and its description's rewrite, or a
        store that lost one): the job is not started afresh in silence;
        every attach is refused saying so until it is released."""
        m = self.manager()
        m.start()
        job = common.job("restart-lost")
        first = Run(m.sock_path, job, pause_s=0.3)
        self.kill_between_steps(m, first, 1)
        with m.lock:  # a buffer's region, as its description names it
            named = set()
            for n, fd in m.store.items():
                if n.startswith("shardd-m") and n[-2:] in ("-a", "-b"):
                    text = os.pread(fd, 1 << 20, 4096).decode(errors="replace")
                    named |= set(re.findall(r"^region buffer \S+ \d+ (\S+)(?: \d+)?$", text, re.M))
            lost = sorted(named & set(m.store))[0]
            os.close(m.store.pop(lost))
        m.start()
        self.assertIn("not resumed: region %s was not handed back" % lost, m.read_log())
        with self.assertRaises(shardd.Error) as cm:
            shardd.Client(m.sock_path, job=job, rank=0, world=2).close()
        self.assertEqual(cm.exception.code_name, "E_STATE")
        self.assertIn("could not be resumed from the fd store", cm.exception.message)
        ctl = shardd.Client(m.sock_path)
        ctl.release_job(job)
        ctl.close()
        again = Run(m.sock_path, job).finish()
        self.assertEqual(again.errors, [])
        self.assertEqual(set(again.starts.values()), {0})

    def test_sigkill_inside_a_step_refuses_naming_it(self):
        m = self.manager()
        # a test-only pause inside every step, after its journal record
        os.environ["SHARDD_TEST_STEP_PAUSE_MS"] = "1500"
        try:
            m.start()
        finally:
            del os.environ["SHARDD_TEST_STEP_PAUSE_MS"]
        job = common.job("torn")
        first = Run(m.sock_path, job)
        first.poll(lambda s: len(s.losses.get(1, {})) == 2)
        # the step journal, as the store holds it, says step 3 is running
        in_step = m.wait_journal_record(timeout=20)
        self.assertEqual(in_step, (3, "adamw"))
        m.kill()
        first.kill()
        done = 2
        m.start()
        self.assertIn("is torn", m.read_log())
        c = None
        with self.assertRaises(shardd.Error) as cm:
            c = shardd.Client(m.sock_path, job=job, rank=0, world=2)
        if c is not None:
            c.close()
        self.assertEqual(cm.exception.code_name, "E_STATE")
        self.assertIn("torn", cm.exception.message)
        self.assertIn("step %d of optimizer \"adamw\"" % (done + 1),
                      cm.exception.message)
        # released, it starts afresh (never resumes the half-applied step)
        ctl = shardd.Client(m.sock_path)
        ctl.release_job(job)
        ctl.close()
        again = Run(m.sock_path, job).finish()
        self.assertEqual(again.errors, [])
        self.assertEqual(set(again.starts.values()), {0})


if __name__ == "__main__":
    unittest.main()

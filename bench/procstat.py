"""What the Python benches read of processes in /proc: resident memory and
CPU time, and a thread that samples both while a run's timed steps go.

CPU time is the figure that survives a shared machine: on one whose
cores are all busy a step takes about the CPU time it needs over the
cores, whoever else runs, where its wall time moves with the load."""
import ctypes
import gc
import os
import threading
import time

_TICK = os.sysconf("SC_CLK_TCK")


def rss(pid="self", shmem=False):
    """Resident private bytes (RssAnon) of a process, with its shared
    memory (RssShmem: memfd and shm mappings) if shmem."""
    got = 0
    with open("/proc/%s/status" % pid) as f:
        for line in f:
            if line.startswith("RssAnon:") or (shmem and line.startswith("RssShmem:")):
                got += int(line.split()[1]) * 1024
    return got


def trimmed_rss():
    """This process's RssAnon once the C heap gave back its free pages:
    what live objects hold, not what glibc keeps for reuse."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    return rss()


def cpu_s(pid="self"):
    """User + system CPU seconds of every thread of a process so far."""
    with open("/proc/%s/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


class Sampler(threading.Thread):
    """Every `period` s, (time.monotonic(), [RssAnon of each pid], the
    daemon's RssAnon + RssShmem, the daemon's CPU seconds) into samples;
    the daemon's figures are 0 without one. time.monotonic() is the
    system's clock, the same in every process, so a rank's timestamps
    select the samples of its timed steps."""

    def __init__(self, pids, daemon_pid=None, period=0.002):
        super().__init__(daemon=True)
        self.pids, self.daemon_pid, self.period = list(pids), daemon_pid, period
        self.samples, self.halt = [], threading.Event()

    def one(self):
        try:
            r = [rss(p) for p in self.pids]
            if self.daemon_pid:
                d, c = rss(self.daemon_pid, shmem=True), cpu_s(self.daemon_pid)
            else:
                d = c = 0
        except (OSError, ValueError, IndexError):  # a process exited
            return None
        return (time.monotonic(), r, d, c)

    def run(self):
        while not self.halt.is_set():
            s = self.one()
            if s:
                self.samples.append(s)
            time.sleep(self.period)

    def stop(self):
        self.halt.set()
        self.join()

    def window(self, t0, t1):
        """The samples between t0 and t1 (all of them if none is)."""
        return [s for s in self.samples if t0 <= s[0] <= t1] or self.samples

    def daemon_cpu(self, t0, t1):
        """The daemon's CPU seconds between the samples nearest t0 and t1."""
        w = self.window(t0, t1)
        return w[-1][3] - w[0][3]

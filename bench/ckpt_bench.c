/* ckpt_bench.c — the exit checkpoint's GB/s (--checkpoint-on-exit, what a
 * stop must finish within the unit's TimeoutStopSec), against what the
 * same disk and memory allow.
 *
 * N jobs of W ranks (host backend, one device per rank), each with U fp32
 * buffers of P parameters and an AdamW optimizer (two state words a
 * parameter, so a job writes 3x its parameters' bytes), written by
 *   serial    each job after the other on one thread (the exit before
 *             shardd__checkpoint_run_many: shardd__checkpoint_write a job),
 *   parallel  shardd__checkpoint_run_many: every file of every job a task on
 *             libuv's pool, as the daemon's exit writes them now,
 * each into a fresh directory, against
 *   dd        the same bytes as one file, write(2) then fsync(2) from one
 *             thread (dd bs=1M conv=fsync),
 *   memcpy    the memory's copy bandwidth on all CPUs.
 * Directories under CKPT_BENCH_DIR (default BENCH_RESULTS/ckpt), removed
 * after; put it on the disk /var/lib/shardd is on. */
#include <dirent.h>
#include <inttypes.h>
#include <uv.h>

#include "backend.h"
#include "bench.h"
#include "checkpoint.h"
#include "optreg.h"
#include "optspec.h"
#include "registry.h"

#define MAX_UNITS 64

static char err[4096];

/* Removes dir's files and dir (one level deep: a job's checkpoint). */
static void rm_tree(const char *dir) {
  DIR *d = opendir(dir);
  if (d == NULL)
    return;
  char path[2048];
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
      continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (unlink(path) != 0)
      rm_tree(path);
  }
  closedir(d);
  rmdir(dir);
}

static void make_job(shardd__registry *reg, int k, uint32_t world, int units,
                     uint64_t params, shardd__job **out) {
  char name[64];
  snprintf(name, sizeof name, "bench%d", k);
  if (shardd__job_get(reg, name, world, 0, out, err, sizeof err) != SHARDD_OK)
    bench_die("%s", err);
  shardd__optspec_ref refs[MAX_UNITS];
  for (int u = 0; u < units; u++) {
    shardd__buffer *b;
    int created;
    snprintf(name, sizeof name, "layer%d", u);
    if (shardd__buffer_register(reg, *out, name, SHARDD_DTYPE_FP32, params, &b,
                                &created, err, sizeof err) != SHARDD_OK)
      bench_die("%s", err);
    /* bytes that are not all alike, as trained weights are */
    for (uint32_t r = 0; r < world; r++) {
      float *p = (float *)((char *)b->blocks[r]->ptr + b->shard_off);
      for (uint64_t i = 0; i < b->shard_numel; i++)
        p[i] = (float)(i % 4093) * 1e-3f + (float)k;
    }
    refs[u] = (shardd__optspec_ref){.id = b->hdr.id};
  }
  shardd__optspec_group grp = {.refs = refs, .nrefs = (size_t)units};
  shardd__optspec spec = {.name = "adamw", .kind = SHARDD_OPTIM_ADAMW,
                          .groups = &grp, .ngroups = 1};
  shardd__optreg_result res;
  if (shardd__optreg_register(reg, *out, &spec, SHARDD__OPTREG_ATTACH, &res, err,
                              sizeof err) != SHARDD_OK)
    bench_die("optimizer: %s %s", err, res.list ? res.list : "");
  free(res.list);
}

static void job_path(char *out, size_t len, const char *root, const char *run,
                     int k) {
  snprintf(out, len, "%s/%s-%d", root, run, k);
}

/* Seconds to write every job with one thread, job after job. */
static double run_serial(shardd__registry *reg, shardd__job **jobs, int n,
                         const char *root) {
  char dir[2048];
  double t0 = bench_now();
  for (int k = 0; k < n; k++) {
    job_path(dir, sizeof dir, root, "serial", k);
    if (shardd__checkpoint_write(reg, jobs[k], dir, -1, err, sizeof err) !=
        SHARDD_OK)
      bench_die("serial checkpoint: %s", err);
  }
  double t = bench_now() - t0;
  for (int k = 0; k < n; k++) {
    job_path(dir, sizeof dir, root, "serial", k);
    rm_tree(dir);
  }
  return t;
}

/* Seconds to write every job at once (run_many); *bytes what it wrote. */
static double run_parallel(uv_loop_t *loop, shardd__registry *reg,
                           shardd__job **jobs, int n, const char *root,
                           uint64_t *bytes) {
  char dir[2048];
  shardd__ckwrite *ws[64];
  shardd_err rcs[64];
  static char errs[64][1024];
  double t0 = bench_now();
  for (int k = 0; k < n; k++) {
    job_path(dir, sizeof dir, root, "parallel", k);
    if (shardd__checkpoint_prepare(reg, jobs[k], dir, -1, NULL, &ws[k], err,
                                   sizeof err) != SHARDD_OK)
      bench_die("prepare: %s", err);
  }
  shardd__checkpoint_run_many(loop, ws, (size_t)n, rcs, &errs[0][0],
                              sizeof errs[0]);
  double t = bench_now() - t0;
  *bytes = 0;
  for (int k = 0; k < n; k++) {
    if (rcs[k] != SHARDD_OK)
      bench_die("parallel checkpoint: %s", errs[k]);
    *bytes += shardd__checkpoint_wbytes(ws[k]);
    shardd__checkpoint_wfree(ws[k]);
    job_path(dir, sizeof dir, root, "parallel", k);
    rm_tree(dir);
  }
  return t;
}

/* Seconds to write bytes from src as one file and fsync it, 1 MiB a write. */
static double run_dd(const char *root, const char *src, uint64_t bytes) {
  char path[2048];
  snprintf(path, sizeof path, "%s/dd", root);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0)
    bench_die("%s: %s", path, strerror(errno));
  double t0 = bench_now();
  for (uint64_t off = 0; off < bytes;) {
    size_t n = bytes - off < (1u << 20) ? (size_t)(bytes - off) : 1u << 20;
    ssize_t w = write(fd, src + (off % ((uint64_t)64 << 20)), n);
    if (w <= 0)
      bench_die("write %s: %s", path, strerror(errno));
    off += (uint64_t)w;
  }
  if (fsync(fd) != 0)
    bench_die("fsync %s: %s", path, strerror(errno));
  double t = bench_now() - t0;
  close(fd);
  unlink(path);
  return t;
}

int main(int argc, char **argv) {
  int full = bench_full(argc, argv);
  /* as the daemon sizes its pool (main.c), before the pool's first use */
  if (getenv("UV_THREADPOOL_SIZE") == NULL) {
    char n[16];
    long cpus = bench_ncpu();
    snprintf(n, sizeof n, "%ld", cpus < 4 ? 4 : cpus > 128 ? 128 : cpus);
    setenv("UV_THREADPOOL_SIZE", n, 1);
  }
  const int njobs = 4, units = 8;
  const uint32_t world = 2;
  const uint64_t params = full ? (uint64_t)8 << 20 : (uint64_t)1 << 20;
  const int reps = 3;

  char root[1024];
  const char *env = getenv("CKPT_BENCH_DIR");
  snprintf(root, sizeof root, "%s", env && env[0] ? env : "");
  if (!root[0])
    snprintf(root, sizeof root, "%s/ckpt", bench_results_dir());
  mkdir(root, 0755);

  /* shards, state and each rank's gathered copy of every buffer */
  uint64_t per_dev = (uint64_t)njobs * units * params * 4 * 5 +
                     ((uint64_t)64 << 20);
  shardd__backend *be;
  if (shardd__backend_host_create((int)world, per_dev, &be, err, sizeof err) !=
      SHARDD_OK)
    bench_die("%s", err);
  shardd__registry reg;
  shardd__registry_init(&reg, be);
  shardd__job *jobs[8];
  for (int k = 0; k < njobs; k++)
    make_job(&reg, k, world, units, params, &jobs[k]);
  uv_loop_t loop;
  if (uv_loop_init(&loop) != 0)
    bench_die("uv_loop_init");

  double ts[8], tp[8], td[8];
  uint64_t bytes = 0;
  /* one buffer's first shard as the dd's source: real bytes, 64 MiB wrap */
  shardd__buffer **bufs;
  size_t nb;
  if (shardd__job_buffers(jobs[0], &bufs, &nb) != SHARDD_OK)
    bench_die("buffers");
  char *src = bench_alloc((size_t)64 << 20);
  memset(src, 0x5a, (size_t)64 << 20);
  memcpy(src, (char *)bufs[0]->blocks[0]->ptr + bufs[0]->shard_off,
         bufs[0]->shard_numel * 4 < ((size_t)64 << 20)
             ? bufs[0]->shard_numel * 4
             : (size_t)64 << 20);
  free(bufs);
  /* each from a clean page cache: what the one before left dirty is
   * flushed first, not billed to the next */
  /* and one untimed write first: the first into a fresh tree ran 2-3x
   * slower here, whichever way it was written */
  sync();
  run_serial(&reg, jobs, njobs, root);
  for (int r = 0; r < reps; r++) {
    sync();
    ts[r] = run_serial(&reg, jobs, njobs, root);
    sync();
    tp[r] = run_parallel(&loop, &reg, jobs, njobs, root, &bytes);
    sync();
    td[r] = run_dd(root, src, bytes);
  }
  double s = bench_median(ts, (size_t)reps), p = bench_median(tp, (size_t)reps),
         d = bench_median(td, (size_t)reps);
  size_t nfl = (size_t)16 << 20; /* 64 MiB a stream */
  float *fa = bench_floor_arrays(nfl);
  double mem = bench_floor_on(FLOOR_COPY, fa, fa + nfl, fa + 2 * nfl, nfl,
                              (int)bench_ncpu(), 3);
  double gb = (double)bytes / GB;
  printf("\nexit checkpoint: %d jobs x %u ranks, %d fp32 buffers of %.0f MiB + "
         "AdamW state each; %.0f MiB in all, %s threads (UV_THREADPOOL_SIZE), "
         "into %s\n",
         njobs, world, units, (double)(params * 4) / MiB, (double)bytes / MiB,
         getenv("UV_THREADPOOL_SIZE"), root);
  printf("%-34s %8s %9s %10s\n", "", "s", "GB/s", "/dd");
  printf("%-34s %8.2f %9.3f %9.2fx\n", "serial (job after job, 1 thread)", s,
         gb / s, d / s);
  printf("%-34s %8.2f %9.3f %9.2fx\n", "parallel (every file on the pool)", p,
         gb / p, d / p);
  printf("%-34s %8.2f %9.3f %9.2fx\n", "dd (1 file, write+fsync)", d, gb / d,
         1.0);
  printf("%-34s %8s %9.2f\n", "memcpy (all CPUs)", "", mem);
  printf("exit checkpoint: %.2f GB/s (%d jobs, %.0f MiB); %.2fx job after job, "
         "%.2fx dd, %.3fx memcpy\n",
         gb / p, njobs, (double)bytes / MiB, s / p, d / p, gb / p / mem);
  printf("at this rate TimeoutStopSec=30s covers %.1f GiB (job after job: %.1f "
         "GiB)\n",
         gb / p * 1e9 * 30 / (1024.0 * 1024 * 1024),
         gb / s * 1e9 * 30 / (1024.0 * 1024 * 1024));

  FILE *f = bench_json_open("ckpt", full);
  fprintf(f, ",\"jobs\":%d,\"world\":%u,\"bytes\":%" PRIu64
          ",\"serial_s\":%.4f,\"parallel_s\":%.4f,\"dd_s\":%.4f,"
          "\"parallel_gbps\":%.4f,\"serial_gbps\":%.4f,\"dd_gbps\":%.4f,"
          "\"memcpy_gbps\":%.3f",
          njobs, world, bytes, s, p, d, gb / p, gb / s, gb / d, mem);
  bench_json_close(f, "ckpt");
  rmdir(root);
  shardd__registry_free(&reg);
  be->ops->destroy(be);
  uv_loop_close(&loop);
  return 0;
}

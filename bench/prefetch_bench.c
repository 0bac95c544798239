/* prefetch_bench.c — how much of the gather time prefetch hides: N layers
 * (fp32 flat buffers) over the host backend, --devices 1 and 2 (one rank
 * per device, one thread and one connection per rank), each repetition
 * timing three loops back to back on the same buffers:
 *
 *   gather:     N shardd_gather() calls, nothing else; g = time / N.
 *   sequential: per layer shardd_gather(), then a compute step of g.
 *   prefetched: FSDP's forward prefetch: gather_async of layer 0; per layer
 *               gather_async of layer l+1, shardd_wait of layer l, a
 *               compute step of g.
 *
 * The compute step is a sleep: it stands for work on an accelerator, during
 * which the trainer's CPU is idle (a busy loop would instead compete with
 * the daemon's copy for the CPUs of a small machine, which measures the
 * machine, not the overlap). With compute as long as the gather, no
 * overlap costs the sum model 2 N g (what sequential measures) and full
 * overlap the max model N g, plus the one gather nothing can hide: the
 * ideal prefetched time is (N + 1) g, i.e. (N + 1) / N of the max model and
 * (N + 1) / 2N of sequential. g is re-measured in every repetition, and
 * the ratios are medians of each repetition's own ratios, so a machine
 * that slows down between repetitions shifts both sides of a ratio.
 *
 * With two CPUs or more the daemon (every thread of it) runs on CPU 0 and
 * the rank threads on CPU 1, as a trainer has its own cores: unpinned on a
 * two-CPU machine, the daemon's copy preempts a rank that has just woken
 * to send its next gather for a whole scheduler slice, which is a figure
 * of the scheduler, not of the overlap. One daemon CPU also means that the
 * two gathers in flight at the start share it: layer 0's wait takes about
 * 2 g, so the reachable figure here is (N + 2) / N of the max model. */
#include "bench.h"

#define MAX_RANKS 2
#define LAYERS 8

typedef enum { CMD_REGISTER, CMD_GATHER, CMD_SEQUENTIAL, CMD_PREFETCHED,
               CMD_RECONNECT } cmd_t;

static bench_daemon dmn;
static int world;
static char job[64];
static bench_ranks ranks;
static uint64_t cur_numel;
static double compute_s; /* the compute step of this repetition */
static shardd_client_t *cl[MAX_RANKS];
static shardd_buffer_info info[MAX_RANKS][LAYERS];

static void check(shardd_err rc, int r, const char *what) {
  if (rc != SHARDD_OK)
    bench_die("rank %d: %s: %s", r, what, shardd_last_error(cl[r]));
}

/* Sleeps until s after now, to an absolute deadline so that an early wake
 * (a signal) does not shorten the step. */
static void compute(double s) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  double ns = (double)ts.tv_nsec + s * 1e9;
  ts.tv_sec += (time_t)(ns / 1e9);
  ts.tv_nsec = (long)(ns - (double)(time_t)(ns / 1e9) * 1e9);
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
    ;
}

static int rank_cpu = -1;

static void rank_body(int r, int c) {
  shardd_buffer_info *b = info[r];
  switch ((cmd_t)c) {
  case CMD_REGISTER:
    for (int l = 0; l < LAYERS; l++) {
      char name[32];
      snprintf(name, sizeof name, "layer%d", l);
      check(shardd_buffer_register(cl[r], name, SHARDD_DTYPE_FP32, cur_numel, &b[l]), r,
            "register");
      /* fill (and fault in) the shard and the gather area once */
      float *s = b[l].shard;
      for (size_t i = 0; i < b[l].shard_numel; i++)
        s[i] = (float)((i + (size_t)l) & 255) * 0.25f;
      memset(b[l].gather, 0, b[l].padded_numel * 4);
    }
    break;
  case CMD_GATHER:
    for (int l = 0; l < LAYERS; l++)
      check(shardd_gather(cl[r], b[l].id), r, "gather");
    break;
  case CMD_SEQUENTIAL:
    for (int l = 0; l < LAYERS; l++) {
      check(shardd_gather(cl[r], b[l].id), r, "gather");
      compute(compute_s);
    }
    break;
  case CMD_PREFETCHED: {
    shardd_ticket t[LAYERS];
    check(shardd_gather_async(cl[r], b[0].id, &t[0]), r, "gather_async");
    for (int l = 0; l < LAYERS; l++) {
      if (l + 1 < LAYERS)
        check(shardd_gather_async(cl[r], b[l + 1].id, &t[l + 1]), r, "gather_async");
      check(shardd_wait(cl[r], t[l]), r, "wait");
      compute(compute_s);
    }
    break;
  }
  case CMD_RECONNECT:
    /* rank 0 has unregistered the buffers; closing unmaps our views */
    shardd_close(cl[r]);
    cl[r] = bench_connect(&dmn, job, (uint32_t)r, (uint32_t)world);
    break;
  }
}

static double run_cmd(cmd_t c) { return bench_ranks_run(&ranks, (int)c); }

typedef struct {
  int devices;
  double mib;
  int reps;
  int skipped;
  double g_s, seq_s, pre_s;        /* medians: per-layer gather, loops */
  double r_max, r_seq, r_sum;      /* medians of per-repetition ratios */
} row_t;

int main(int argc, char **argv) {
  int full = bench_full(argc, argv);
  static const double sizes_short[] = {4, 16};
  static const double sizes_full[] = {4, 16, 64};
  const double *sizes = full ? sizes_full : sizes_short;
  int nsizes = full ? 3 : 2;
  int reps = full ? 25 : 15;
  int daemon_cpu = bench_ncpu() >= 2 ? 0 : -1;
  rank_cpu = bench_ncpu() >= 2 ? 1 : -1;
  static const int devs[] = {1, 2};
  row_t rows[2 * 3];
  int nrows = 0;
  double maxn = sizes[nsizes - 1] * MiB;

  for (int di = 0; di < 2; di++) {
    world = devs[di];
    char devmem[32];
    /* per rank and layer: shard + reduced (1/world each) + gather + grad */
    snprintf(devmem, sizeof devmem, "%.0fM",
             LAYERS * (2.0 * maxn + 2.0 * maxn / world) / MiB + 64);
    bench_daemon_start_on(&dmn, world, devmem, daemon_cpu);
    snprintf(job, sizeof job, "prefetch%d", world);
    for (int r = 0; r < world; r++)
      cl[r] = bench_connect(&dmn, job, (uint32_t)r, (uint32_t)world);
    bench_ranks_start(&ranks, world, rank_cpu, rank_body);
    for (int si = 0; si < nsizes; si++) {
      row_t *row = &rows[nrows++];
      memset(row, 0, sizeof *row);
      row->devices = world;
      row->mib = sizes[si];
      double bytes = sizes[si] * MiB;
      double need = LAYERS * (2.0 * bytes * world + 2.0 * bytes);
      double avail = bench_mem_available();
      if (avail > 0 && need > 0.6 * avail) {
        row->skipped = 1;
        fprintf(stderr, "prefetch_bench: skipping %d devices x %.0f MiB: needs %.1f GiB, "
                        "%.1f GiB available\n", world, sizes[si], need / (MiB * 1024),
                avail / (MiB * 1024));
        continue;
      }
      cur_numel = (uint64_t)(bytes / 4);
      run_cmd(CMD_REGISTER);
      row->reps = reps;
      double *v[6];
      for (int k = 0; k < 6; k++)
        v[k] = calloc((size_t)reps, sizeof(double));
      compute_s = run_cmd(CMD_GATHER) / LAYERS; /* warm-up */
      run_cmd(CMD_SEQUENTIAL);
      run_cmd(CMD_PREFETCHED);
      for (int rep = 0; rep < reps; rep++) {
        double g = run_cmd(CMD_GATHER) / LAYERS;
        compute_s = g;
        double seq = run_cmd(CMD_SEQUENTIAL);
        double pre = run_cmd(CMD_PREFETCHED);
        v[0][rep] = g;
        v[1][rep] = seq;
        v[2][rep] = pre;
        v[3][rep] = pre / (LAYERS * g);
        v[4][rep] = pre / seq;
        v[5][rep] = seq / (2.0 * LAYERS * g);
      }
      row->g_s = bench_median(v[0], (size_t)reps);
      row->seq_s = bench_median(v[1], (size_t)reps);
      row->pre_s = bench_median(v[2], (size_t)reps);
      row->r_max = bench_median(v[3], (size_t)reps);
      row->r_seq = bench_median(v[4], (size_t)reps);
      row->r_sum = bench_median(v[5], (size_t)reps);
      for (int k = 0; k < 6; k++)
        free(v[k]);
      for (int l = 0; l < LAYERS; l++)
        if (shardd_buffer_unregister(cl[0], info[0][l].id) != SHARDD_OK)
          bench_die("unregister: %s", shardd_last_error(cl[0]));
      run_cmd(CMD_RECONNECT);
    }
    bench_ranks_stop(&ranks);
    for (int r = 0; r < world; r++)
      shardd_close(cl[r]);
    bench_daemon_stop(&dmn);
  }

  char cpu[256];
  bench_cpu_model(cpu, sizeof cpu);
  printf("\nPrefetch — %d layers, compute step (a sleep) = gather time g, host backend, "
         "fp32, ranks = devices, %s (%ld CPUs%s)\n", LAYERS, cpu, bench_ncpu(),
         daemon_cpu >= 0 ? "; daemon on CPU 0, ranks on CPU 1" : "");
  printf("%3s %7s | %8s %10s %10s | %9s %9s %9s\n", "dev", "layer", "g", "sequential",
         "prefetched", "pre/(Ng)", "pre/seq", "seq/(2Ng)");
  printf("%3s %7s | %8s %10s %10s | %9s %9s %9s\n", "", "", "ms", "ms", "ms", "max model",
         "", "sum model");
  FILE *f = bench_json_open("prefetch", full);
  fprintf(f, ",\n  \"layers\": %d,\n  \"rows\": [", LAYERS);
  int first = 1;
  for (int i = 0; i < nrows; i++) {
    row_t *r = &rows[i];
    if (r->skipped) {
      printf("%3d %4.0f MiB | skipped (not enough free memory)\n", r->devices, r->mib);
      continue;
    }
    printf("%3d %4.0f MiB | %8.2f %10.1f %10.1f | %8.2fx %8.2fx %8.2fx\n", r->devices,
           r->mib, r->g_s * 1e3, r->seq_s * 1e3, r->pre_s * 1e3, r->r_max, r->r_seq,
           r->r_sum);
    fprintf(f, "%s\n    {\"devices\": %d, \"layer_bytes\": %.0f, \"reps\": %d, "
               "\"gather_s\": %.6g, \"sequential_s\": %.6g, \"prefetched_s\": %.6g, "
               "\"prefetched_over_max_model\": %.4f, \"prefetched_over_sequential\": %.4f, "
               "\"sequential_over_sum_model\": %.4f}",
            first ? "" : ",", r->devices, r->mib * MiB, r->reps, r->g_s, r->seq_s,
            r->pre_s, r->r_max, r->r_seq, r->r_sum);
    first = 0;
  }
  /* the first gather is never hidden; on one daemon CPU the second delays it */
  double ideal = (LAYERS + (daemon_cpu >= 0 ? 2.0 : 1.0)) / LAYERS;
  printf("(g = %d back-to-back gathers / %d; times are medians, ratios medians of each\n"
         " repetition's own; full overlap here: pre/(Ng) = %.3fx, pre/seq = %.3fx;\n"
         " none: pre/(Ng) = 2x, pre/seq = 1x)\n",
         LAYERS, LAYERS, ideal, ideal / 2);
  fprintf(f, "\n  ],\n  \"pinned\": %s,\n  \"ideal_prefetched_over_max_model\": %.4f,"
             "\n  \"ideal_prefetched_over_sequential\": %.4f",
          daemon_cpu >= 0 ? "true" : "false", ideal, ideal / 2);
  bench_json_close(f, "prefetch");
  return 0;
}

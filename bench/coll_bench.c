/* coll_bench.c — gather (all-gather) and scatter (reduce-scatter) throughput
 * of the host backend, --devices 1, 2 and 4 (one rank per device, one thread
 * and one connection per rank), fp32 buffers of 1 MiB up to 64 MiB (FULL=1:
 * up to 1 GiB), against floors measured in the same process on the very
 * same memory (the rank blocks the clients have mapped):
 *
 *   gather, the design's (transient areas, FSDP's FULL_SHARD): a node holds
 *     one read-only gathered copy of the buffer that every local rank maps,
 *     so a gather copies each shard once (world shard copies);
 *   node floor (the gather ratio's): the rank threads memcpy() each shard
 *     once into one area (rank r its own shard into its place in rank 0's
 *     gather area) — the bytes the design's gather copies, with the same
 *     number of threads, minus the daemon;
 *   per-rank floor (reported beside it, and the resident gather's ratio):
 *     each rank thread memcpy()s every rank's shard into its own gather
 *     area, world x world shard copies — what a gather did when every rank
 *     had its own copy, and what one of resident areas still does.
 *   scatter floor: each rank thread sums its slice of every rank's gradient
 *     into its reduced shard with a plain one-pass loop (acc[i] = g0[i] +
 *     g1[i] + ...), the bytes the daemon's reduce must read and write.
 *
 * GB/s counts payload: gather = world x buffer bytes delivered to the ranks
 * (a node's copy delivers the buffer to every local rank); scatter = world x
 * buffer bytes of gradient reduced. Repetitions of daemon and floor
 * alternate; medians are reported.
 *
 * Small buffers (issue 17): 1 MiB in SMALL_N buffers of 16 KiB (a model's
 * norms and biases), gathered and scattered one request per buffer and as
 * buckets (shardd_gather_many / shardd_scatter_many, one request per 64),
 * against the same floors over the same buffers. */
#include "bench.h"

#include <dirent.h>

#define MAX_RANKS 4

typedef enum { CMD_REGISTER, CMD_GATHER, CMD_SCATTER, CMD_FLOOR_GATHER,
               CMD_FLOOR_SUM, CMD_RECONNECT, CMD_SMALL_REGISTER,
               CMD_SMALL_GATHER, CMD_BUCKET_GATHER, CMD_SMALL_FLOOR_GATHER,
               CMD_SMALL_SCATTER, CMD_BUCKET_SCATTER, CMD_SMALL_FLOOR_SUM,
               CMD_SMALL_UNREGISTER, CMD_TINY_GATHER, CMD_TINY_FLOOR,
               CMD_NODE_GATHER, CMD_FLOOR_NODE, CMD_NODE_RELEASE } cmd_t;

/* the small-buffer figure: SMALL_N buffers of SMALL_BYTES */
#define SMALL_N 64
#define SMALL_BYTES (16 * 1024)

static bench_daemon dmn;
static int world;
static char job[64];
static bench_ranks ranks;
static uint64_t cur_numel;
static shardd_client_t *cl[MAX_RANKS];
static shardd_buffer_info info[MAX_RANKS];
/* the transient job of the same ranks: the design's gather */
static char tjob[64];
static shardd_client_t *tcl[MAX_RANKS];
static shardd_buffer_info tinfo[MAX_RANKS];

static shardd_client_t *connect_transient(uint32_t rank) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = tjob;
  o.rank = rank;
  o.world = (uint32_t)world;
  o.transient_areas = 1;
  o.client_name = "bench";
  shardd_client_t *c;
  char err[512];
  if (shardd_connect(dmn.socket, &o, &c, err, sizeof err) != SHARDD_OK)
    bench_die("connect %s: %s", dmn.socket, err);
  return c;
}

static shardd_buffer_info small[MAX_RANKS][SMALL_N];
static uint64_t small_ids[MAX_RANKS][SMALL_N];
/* a collective's fixed cost: a gather of TINY_NUMEL floats */
#define TINY_NUMEL 64
static shardd_buffer_info tiny[MAX_RANKS];

static void check(shardd_err rc, int r, const char *what) {
  if (rc != SHARDD_OK)
    bench_die("rank %d: %s: %s", r, what, shardd_last_error(cl[r]));
}

/* rank r's sum of its shard of buffer in[] over every rank */
static void floor_sum_of(int r, const shardd_buffer_info *in) {
  size_t n = in[r].shard_numel;
  float *restrict acc = in[r].reduced;
  const float *g[MAX_RANKS];
  for (int q = 0; q < world; q++)
    g[q] = (const float *)in[q].grad + (size_t)r * n;
  switch (world) {
  case 1:
    for (size_t i = 0; i < n; i++)
      acc[i] = g[0][i];
    break;
  case 2:
    for (size_t i = 0; i < n; i++)
      acc[i] = g[0][i] + g[1][i];
    break;
  default:
    for (size_t i = 0; i < n; i++)
      acc[i] = (g[0][i] + g[1][i]) + (g[2][i] + g[3][i]);
    break;
  }
}

static void floor_sum(int r) { floor_sum_of(r, info); }

static void fill(const shardd_buffer_info *b, int r) {
  float *sh = b->shard, *g = b->grad;
  for (size_t i = 0; i < b->shard_numel; i++)
    sh[i] = (float)((i + (size_t)r) & 255) * 0.25f;
  for (size_t i = 0; i < b->padded_numel; i++)
    g[i] = (float)(i & 127) * 0.5f;
  memset(b->gather, 0, b->padded_numel * 4);
  memset(b->reduced, 0, b->shard_numel * 4);
}

/* The rank threads' CPU seconds inside the small floors (their copies and
 * sums, not the harness's barriers), summed over ranks since the last
 * reset: set by small_body, read by small_figure. */
static double floor_cpu_s[MAX_RANKS];

static double thread_cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void small_floor(int r, cmd_t c);

static void small_body(int r, cmd_t c) {
  if (c == CMD_SMALL_FLOOR_GATHER || c == CMD_SMALL_FLOOR_SUM) {
    double t0 = thread_cpu_s();
    small_floor(r, c);
    floor_cpu_s[r] += thread_cpu_s() - t0;
    return;
  }
  switch (c) {
  case CMD_SMALL_REGISTER: {
    shardd_buffer_spec sp[SMALL_N];
    char names[SMALL_N][16];
    for (int k = 0; k < SMALL_N; k++) {
      shardd_buffer_spec e = SHARDD_BUFFER_SPEC_INIT;
      snprintf(names[k], sizeof names[k], "small%d", k);
      e.name = names[k];
      e.numel = SMALL_BYTES / 4;
      sp[k] = e;
    }
    check(shardd_buffers_register(cl[r], SMALL_N, sp, small[r], NULL), r,
          "register small buffers");
    for (int k = 0; k < SMALL_N; k++) {
      small_ids[r][k] = small[r][k].id;
      fill(&small[r][k], r);
    }
    check(shardd_buffer_register(cl[r], "tiny", SHARDD_DTYPE_FP32, TINY_NUMEL,
                                 &tiny[r]), r, "register tiny buffer");
    fill(&tiny[r], r);
    break;
  }
  case CMD_TINY_GATHER:
    check(shardd_gather(cl[r], tiny[r].id), r, "gather tiny");
    break;
  case CMD_TINY_FLOOR: {
    /* the same bytes copied: what is left is the harness's own round */
    size_t bytes = tiny[r].shard_numel * 4;
    for (int q = 0; q < world; q++)
      memcpy((char *)tiny[r].gather + (size_t)q * bytes, tiny[q].shard, bytes);
    break;
  }
  case CMD_SMALL_GATHER:
    for (int k = 0; k < SMALL_N; k++)
      check(shardd_gather(cl[r], small_ids[r][k]), r, "gather");
    break;
  case CMD_BUCKET_GATHER:
    check(shardd_gather_many(cl[r], SMALL_N, small_ids[r], NULL), r, "gather_many");
    break;
  case CMD_SMALL_SCATTER:
    for (int k = 0; k < SMALL_N; k++)
      check(shardd_scatter(cl[r], small_ids[r][k], SHARDD_REDUCE_SUM), r, "scatter");
    break;
  case CMD_BUCKET_SCATTER:
    check(shardd_scatter_many(cl[r], SMALL_N, small_ids[r], SHARDD_REDUCE_SUM, NULL),
          r, "scatter_many");
    break;
  case CMD_SMALL_UNREGISTER:
    if (r == 0) {
      check(shardd_buffers_unregister(cl[0], SMALL_N, small_ids[0], NULL, NULL),
            0, "unregister small buffers");
      check(shardd_buffer_unregister(cl[0], tiny[0].id), 0, "unregister tiny buffer");
    }
    break;
  default:
    break;
  }
}

/* The floors of the small buffers: rank r memcpy()s every rank's shard
 * of each buffer into its gather area, or sums its slice of each. */
static void small_floor(int r, cmd_t c) {
  if (c == CMD_SMALL_FLOOR_GATHER) {
    for (int k = 0; k < SMALL_N; k++) {
      size_t bytes = small[r][k].shard_numel * 4;
      for (int q = 0; q < world; q++)
        memcpy((char *)small[r][k].gather + (size_t)q * bytes, small[q][k].shard,
               bytes);
    }
    return;
  }
  shardd_buffer_info col[MAX_RANKS];
  for (int k = 0; k < SMALL_N; k++) {
    for (int q = 0; q < world; q++)
      col[q] = small[q][k];
    floor_sum_of(r, col);
  }
}

static void rank_body(int r, int c) {
  if (c >= CMD_SMALL_REGISTER && c < CMD_NODE_GATHER) {
    small_body(r, (cmd_t)c);
    return;
  }
  switch ((cmd_t)c) {
  case CMD_REGISTER: {
    check(shardd_buffer_register(cl[r], "flat", SHARDD_DTYPE_FP32, cur_numel,
                                 &info[r]),
          r, "register");
    fill(&info[r], r); /* fill (and fault in) every area once */
    if (shardd_buffer_register(tcl[r], "flat", SHARDD_DTYPE_FP32, cur_numel,
                               &tinfo[r]) != SHARDD_OK)
      bench_die("rank %d: register (transient): %s", r, shardd_last_error(tcl[r]));
    memcpy(tinfo[r].shard, info[r].shard, info[r].shard_numel * 4);
    break;
  }
  case CMD_NODE_GATHER: {
    /* gathering a unit this rank holds gathers it again, into the same
     * node's copy: released when the size is done */
    shardd_area a;
    if (shardd_gather_area(tcl[r], tinfo[r].id, 0, &a) != SHARDD_OK)
      bench_die("rank %d: gather (transient): %s", r, shardd_last_error(tcl[r]));
    break;
  }
  case CMD_NODE_RELEASE:
    if (shardd_release(tcl[r], tinfo[r].id) != SHARDD_OK)
      bench_die("rank %d: release: %s", r, shardd_last_error(tcl[r]));
    break;
  case CMD_FLOOR_NODE: {
    size_t bytes = info[r].shard_numel * 4;
    memcpy((char *)info[0].gather + (size_t)r * bytes, info[r].shard, bytes);
    break;
  }
  case CMD_GATHER:
    check(shardd_gather(cl[r], info[r].id), r, "gather");
    break;
  case CMD_SCATTER:
    check(shardd_scatter(cl[r], info[r].id, SHARDD_REDUCE_SUM), r, "scatter");
    break;
  case CMD_FLOOR_GATHER: {
    size_t bytes = info[r].shard_numel * 4;
    for (int q = 0; q < world; q++)
      memcpy((char *)info[r].gather + (size_t)q * bytes, info[q].shard, bytes);
    break;
  }
  case CMD_FLOOR_SUM:
    floor_sum(r);
    break;
  case CMD_RECONNECT:
    /* rank 0 has unregistered the buffer; closing unmaps our view of it */
    shardd_close(cl[r]);
    cl[r] = bench_connect(&dmn, job, (uint32_t)r, (uint32_t)world);
    if (tcl[r] != NULL) {
      shardd_close(tcl[r]); /* its lease and its mappings go with it */
      tcl[r] = connect_transient((uint32_t)r);
    }
    break;
  default:
    break;
  }
}

static double run_cmd(cmd_t c) { return bench_ranks_run(&ranks, (int)c); }

typedef struct {
  int devices;
  double mib;
  int reps;
  int skipped;
  double gather_s, gfloor_s, scatter_s, sfloor_s;
  double node_s, nfloor_s; /* the design's gather and its floor */
} row_t;

/* the small-buffer figure of one device count: medians of one request per
 * buffer, of buckets and of the floor, gather then scatter */
typedef struct {
  int devices;
  int reps;
  double t[8];
  /* the daemon's CPU seconds (every thread) per bucket gather and per
   * bucket scatter, means over the repetitions: what the daemon spends,
   * apart from how long it waited for a CPU or for the ranks */
  double cpu_gather_s, cpu_scatter_s;
  /* the rank threads' CPU seconds per floor round (memcpy, sum loop),
   * summed over ranks, means: what the floors spend */
  double cpu_memcpy_s, cpu_sum_s;
} small_row_t;

/* CPU seconds the daemon's threads have run so far (schedstat: ns, not
 * clock ticks), -1 when unreadable. */
static double daemon_cpu_s(void) {
  char dir[64];
  snprintf(dir, sizeof dir, "/proc/%d/task", (int)dmn.pid);
  DIR *d = opendir(dir);
  if (d == NULL)
    return -1;
  double ns = 0;
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    if (de->d_name[0] == '.')
      continue;
    char path[384];
    snprintf(path, sizeof path, "%s/%s/schedstat", dir, de->d_name);
    FILE *f = fopen(path, "r");
    unsigned long long run = 0;
    if (f != NULL) {
      if (fscanf(f, "%llu", &run) == 1)
        ns += (double)run;
      fclose(f);
    }
  }
  closedir(d);
  return ns * 1e-9;
}

#define NSMALL 8
static const cmd_t small_order[NSMALL] = {
    CMD_SMALL_GATHER,  CMD_BUCKET_GATHER,  CMD_SMALL_FLOOR_GATHER,
    CMD_SMALL_SCATTER, CMD_BUCKET_SCATTER, CMD_SMALL_FLOOR_SUM,
    CMD_TINY_GATHER,   CMD_TINY_FLOOR};

/* --bucket: only the buckets and their floors (profiling the daemon's side) */
static int bucket_only;

static void small_figure(small_row_t *row, int reps) {
  run_cmd(CMD_SMALL_REGISTER);
  row->devices = world;
  row->reps = reps;
  double *t[NSMALL];
  for (int k = 0; k < NSMALL; k++)
    t[k] = calloc((size_t)reps, sizeof(double));
  for (int k = 0; k < NSMALL; k++) /* warm-up */
    run_cmd(small_order[k]);
  double cpu[NSMALL] = {0}, fcpu[NSMALL] = {0};
  for (int rep = 0; rep < reps; rep++)
    for (int k = 0; k < NSMALL; k++) {
      if (bucket_only && k != 1 && k != 2 && k != 4 && k != 5)
        continue;
      double c0 = daemon_cpu_s();
      for (int r = 0; r < world; r++)
        floor_cpu_s[r] = 0;
      t[k][rep] = run_cmd(small_order[k]);
      cpu[k] += daemon_cpu_s() - c0;
      for (int r = 0; r < world; r++)
        fcpu[k] += floor_cpu_s[r];
    }
  row->cpu_gather_s = cpu[1] / reps;
  row->cpu_scatter_s = cpu[4] / reps;
  row->cpu_memcpy_s = fcpu[2] / reps;
  row->cpu_sum_s = fcpu[5] / reps;
  for (int k = 0; k < NSMALL; k++) {
    row->t[k] = bench_median(t[k], (size_t)reps);
    free(t[k]);
  }
  run_cmd(CMD_SMALL_UNREGISTER);
  run_cmd(CMD_RECONNECT);
}

int main(int argc, char **argv) {
  int full = bench_full(argc, argv);
  static const double sizes_short[] = {1, 4, 16, 64};
  static const double sizes_full[] = {1, 4, 16, 64, 256, 1024};
  const double *sizes = full ? sizes_full : sizes_short;
  int nsizes = full ? 6 : 4;
  /* --small: only the small-buffer and fixed-cost figures (seconds, not
   * minutes: for comparing two builds of the daemon) */
  /* --bucket: only the 4-device buckets and their floors, 200 repetitions,
   * with the daemon's CPU per bucket (for profiling the daemon's side) */
  /* --node: only the design's gather of the largest buffer and its floor
   * at 2 and 4 devices, more repetitions (comparing two builds' splits of
   * the shared copy) */
  int node_only = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--small") == 0)
      nsizes = 0;
    if (strcmp(argv[i], "--node") == 0)
      node_only = 1;
    if (strcmp(argv[i], "--bucket") == 0)
      nsizes = 0, bucket_only = 1;
  }
  static const int devs[] = {1, 2, 4};
  double budget = (full ? 16384.0 : 2048.0) * MiB; /* gathered bytes per config */
  row_t rows[3 * 6];
  small_row_t smalls[3];
  int nrows = 0;
  double maxn = sizes[(full ? 6 : 4) - 1] * MiB;

  for (int di = node_only ? 1 : bucket_only ? 2 : 0; di < 3; di++) {
    world = devs[di];
    char devmem[32];
    /* one rank per device: shard + reduced + gather + grad, with slack;
     * the transient job's shard + reduced, and on device 0 its node's
     * gather pool of world + 1 slots */
    snprintf(devmem, sizeof devmem, "%.0fM",
             (2.0 * maxn + 4.0 * maxn / world + (world + 1.0) * maxn) / MiB + 64);
    bench_daemon_start(&dmn, world, devmem);
    snprintf(job, sizeof job, "coll%d", world);
    snprintf(tjob, sizeof tjob, "collnode%d", world);
    for (int r = 0; r < world; r++) {
      cl[r] = bench_connect(&dmn, job, (uint32_t)r, (uint32_t)world);
      tcl[r] = nsizes > 0 ? connect_transient((uint32_t)r) : NULL;
    }
    bench_ranks_start(&ranks, world, -1, rank_body);
    for (int si = node_only ? nsizes - 1 : 0; si < nsizes; si++) {
      row_t *row = &rows[nrows++];
      memset(row, 0, sizeof *row);
      row->devices = world;
      row->mib = sizes[si];
      double bytes = sizes[si] * MiB;
      double need = 2.0 * bytes * world + 4.0 * bytes + (world + 1.0) * bytes;
      double avail = bench_mem_available();
      if (avail > 0 && need > 0.6 * avail) {
        row->skipped = 1;
        fprintf(stderr, "coll_bench: skipping %d devices x %.0f MiB: needs %.1f GiB, "
                        "%.1f GiB available\n", world, sizes[si], need / (MiB * 1024),
                avail / (MiB * 1024));
        continue;
      }
      cur_numel = (uint64_t)(bytes / 4);
      run_cmd(CMD_REGISTER);
      int reps = (int)(budget / (bytes * world));
      reps = reps < 3 ? 3 : reps > 40 ? 40 : reps;
      if (node_only)
        reps = 25;
      row->reps = reps;
      enum { NORDER = 6 };
      double *t[NORDER];
      for (int k = 0; k < NORDER; k++)
        t[k] = calloc((size_t)reps, sizeof(double));
      static const cmd_t order[NORDER] = {CMD_GATHER, CMD_FLOOR_GATHER, CMD_SCATTER,
                                          CMD_FLOOR_SUM, CMD_NODE_GATHER,
                                          CMD_FLOOR_NODE};
      for (int k = 0; k < NORDER; k++) /* warm-up */
        run_cmd(order[k]);
      for (int rep = 0; rep < reps; rep++)
        for (int k = node_only ? 4 : 0; k < NORDER; k++)
          t[k][rep] = run_cmd(order[k]);
      row->gather_s = bench_median(t[0], (size_t)reps);
      row->gfloor_s = bench_median(t[1], (size_t)reps);
      row->scatter_s = bench_median(t[2], (size_t)reps);
      row->sfloor_s = bench_median(t[3], (size_t)reps);
      row->node_s = bench_median(t[4], (size_t)reps);
      row->nfloor_s = bench_median(t[5], (size_t)reps);
      for (int k = 0; k < NORDER; k++)
        free(t[k]);
      if (shardd_buffer_unregister(cl[0], info[0].id) != SHARDD_OK)
        bench_die("unregister: %s", shardd_last_error(cl[0]));
      run_cmd(CMD_NODE_RELEASE);
      if (shardd_buffer_unregister(tcl[0], tinfo[0].id) != SHARDD_OK)
        bench_die("unregister (transient): %s", shardd_last_error(tcl[0]));
      run_cmd(CMD_RECONNECT);
    }
    if (!node_only)
      small_figure(&smalls[di], bucket_only ? 200 : full ? 100 : 30);
    bench_ranks_stop(&ranks);
    for (int r = 0; r < world; r++) {
      shardd_close(cl[r]);
      shardd_close(tcl[r]);
      tcl[r] = NULL;
    }
    bench_daemon_stop(&dmn);
  }

  char cpu[256];
  bench_cpu_model(cpu, sizeof cpu);
  printf("\nGather / scatter — host backend, fp32, ranks = devices, %s (%ld CPUs)\n",
         cpu, bench_ncpu());
  printf("%3s %9s | %9s %9s %6s %9s | %9s %9s %6s | %9s %9s %6s\n", "dev", "buffer",
         "gather", "node", "ratio", "per-rank", "resident", "per-rank", "ratio",
         "scatter", "sum loop", "ratio");
  printf("%3s %9s | %9s %9s %6s %9s | %9s %9s %6s | %9s %9s %6s\n", "", "", "GB/s",
         "memcpy", "", "memcpy", "gather", "memcpy", "", "GB/s", "GB/s", "");
  const char *jname = node_only ? "coll_node" : bucket_only ? "coll_bucket" : "coll";
  FILE *f = bench_json_open(jname, full);
  fprintf(f, ",\n  \"rows\": [");
  int first = 1;
  for (int i = 0; i < nrows; i++) {
    row_t *r = &rows[i];
    char sz[32];
    if (r->mib >= 1024)
      snprintf(sz, sizeof sz, "%.0f GiB", r->mib / 1024);
    else
      snprintf(sz, sizeof sz, "%.0f MiB", r->mib);
    if (r->skipped) {
      printf("%3d %9s | skipped (not enough free memory)\n", r->devices, sz);
      continue;
    }
    double moved = r->mib * MiB * r->devices / GB;
    double ng = moved / r->node_s, nf = moved / r->nfloor_s;
    if (node_only) {
      printf("%3d %9s | %9.2f %9.2f %5.2fx (%d reps)\n", r->devices, sz, ng, nf,
             ng / nf, r->reps);
      fprintf(f, "%s\n    {\"devices\": %d, \"buffer_bytes\": %.0f, \"reps\": %d, "
                 "\"gather_s\": %.6g, \"node_memcpy_s\": %.6g, \"gather_ratio\": %.4f}",
              first ? "" : ",", r->devices, r->mib * MiB, r->reps, r->node_s,
              r->nfloor_s, ng / nf);
      first = 0;
      continue;
    }
    double g = moved / r->gather_s, gf = moved / r->gfloor_s;
    double s = moved / r->scatter_s, sf = moved / r->sfloor_s;
    printf("%3d %9s | %9.2f %9.2f %5.2fx %9.2f | %9.2f %9.2f %5.2fx | %9.2f %9.2f %5.2fx\n",
           r->devices, sz, ng, nf, ng / nf, gf, g, gf, g / gf, s, sf, s / sf);
    fprintf(f, "%s\n    {\"devices\": %d, \"buffer_bytes\": %.0f, \"reps\": %d, "
               "\"gather_s\": %.6g, \"gather_GBps\": %.4g, \"node_memcpy_GBps\": %.4g, "
               "\"gather_ratio\": %.4f, \"per_rank_memcpy_GBps\": %.4g, "
               "\"gather_per_rank_ratio\": %.4f, "
               "\"resident_gather_s\": %.6g, \"resident_gather_GBps\": %.4g, "
               "\"resident_gather_ratio\": %.4f, "
               "\"scatter_s\": %.6g, \"scatter_GBps\": %.4g, "
               "\"sum_loop_GBps\": %.4g, \"scatter_ratio\": %.4f}",
            first ? "" : ",", r->devices, r->mib * MiB, r->reps, r->node_s, ng, nf,
            ng / nf, gf, ng / gf, r->gather_s, g, g / gf, r->scatter_s, s, sf, s / sf);
    first = 0;
  }
  printf("(GB/s = world x buffer bytes delivered to the ranks per collective / median\n"
         " time; floors run by the same rank threads on the same mapped memory; ratio =\n"
         " daemon / floor. gather: the design's, transient areas, one read-only copy\n"
         " per node; its ratio is against the node memcpy, each shard copied once; the\n"
         " per-rank memcpy, each rank copying every shard into its own area, is the\n"
         " floor of the resident gather, which still does that)\n");
  if (node_only) {
    fprintf(f, "\n  ]");
    bench_json_close(f, "coll_node");
    return 0;
  }
  fprintf(f, "\n  ],\n  \"small_buffers\": %d, \"small_buffer_bytes\": %d, "
             "\"bucket\": %d,\n  \"small_rows\": [", SMALL_N, SMALL_BYTES,
          SHARDD_BUCKET_PER_REQUEST);
  printf("\nSmall buffers — %d of %d KiB (%.0f MiB), one request each vs buckets "
         "(shardd_gather_many / _scatter_many)\n", SMALL_N, SMALL_BYTES / 1024,
         SMALL_N * (double)SMALL_BYTES / MiB);
  if (bucket_only) {
    printf("%3s | %9s %9s %6s %9s %9s | %9s %9s %6s %9s %9s\n", "dev", "bucketed",
           "memcpy", "ratio", "daemon", "memcpy", "bucketed", "sum loop", "ratio",
           "daemon", "sum loop");
    printf("%3s | %9s %9s %6s %9s %9s | %9s %9s %6s %9s %9s\n", "", "gather", "GB/s",
           "", "CPU us", "CPU us", "scatter", "GB/s", "", "CPU us", "CPU us");
  } else {
    printf("%3s | %9s %9s %9s %6s %6s | %9s %9s %9s %6s %6s\n", "dev", "gather",
           "bucketed", "memcpy", "each", "bucket", "scatter", "bucketed", "sum loop",
           "each", "bucket");
    printf("%3s | %9s %9s %9s %6s %6s | %9s %9s %9s %6s %6s\n", "", "GB/s", "GB/s",
           "GB/s", "ratio", "ratio", "GB/s", "GB/s", "GB/s", "ratio", "ratio");
  }
  for (int i = bucket_only ? 2 : 0; i < 3; i++) {
    const small_row_t *r = &smalls[i];
    double moved = (double)SMALL_N * SMALL_BYTES * r->devices / GB;
    double v[6];
    for (int k = 0; k < 6; k++)
      v[k] = moved / r->t[k];
    if (bucket_only)
      printf("%3d | %9.2f %9.2f %5.2fx %9.1f %9.1f | %9.2f %9.2f %5.2fx %9.1f %9.1f\n",
             r->devices, v[1], v[2], v[1] / v[2], r->cpu_gather_s * 1e6,
             r->cpu_memcpy_s * 1e6, v[4], v[5], v[4] / v[5], r->cpu_scatter_s * 1e6,
             r->cpu_sum_s * 1e6);
    else
      printf("%3d | %9.2f %9.2f %9.2f %5.2fx %5.2fx | %9.2f %9.2f %9.2f %5.2fx %5.2fx\n",
             r->devices, v[0], v[1], v[2], v[0] / v[2], v[1] / v[2], v[3], v[4], v[5],
             v[3] / v[5], v[4] / v[5]);
    if (bucket_only) {
      fprintf(f, "\n    {\"devices\": %d, \"reps\": %d, \"gather_bucket_s\": %.6g, "
                 "\"memcpy_s\": %.6g, \"gather_bucket_ratio\": %.4f, "
                 "\"scatter_bucket_s\": %.6g, \"sum_loop_s\": %.6g, "
                 "\"scatter_bucket_ratio\": %.4f, \"gather_bucket_daemon_cpu_s\": %.6g, "
                 "\"scatter_bucket_daemon_cpu_s\": %.6g, \"memcpy_cpu_s\": %.6g, "
                 "\"sum_loop_cpu_s\": %.6g}",
              r->devices, r->reps, r->t[1], r->t[2], v[1] / v[2], r->t[4], r->t[5],
              v[4] / v[5], r->cpu_gather_s, r->cpu_scatter_s, r->cpu_memcpy_s,
              r->cpu_sum_s);
      continue;
    }
    fprintf(f, "%s\n    {\"devices\": %d, \"reps\": %d, \"gather_each_s\": %.6g, "
               "\"gather_bucket_s\": %.6g, \"memcpy_s\": %.6g, "
               "\"gather_each_ratio\": %.4f, \"gather_bucket_ratio\": %.4f, "
               "\"scatter_each_s\": %.6g, \"scatter_bucket_s\": %.6g, "
               "\"sum_loop_s\": %.6g, \"scatter_each_ratio\": %.4f, "
               "\"scatter_bucket_ratio\": %.4f, \"tiny_gather_s\": %.6g, "
               "\"tiny_floor_s\": %.6g, \"gather_bucket_daemon_cpu_s\": %.6g, "
               "\"scatter_bucket_daemon_cpu_s\": %.6g, \"memcpy_cpu_s\": %.6g, "
               "\"sum_loop_cpu_s\": %.6g}",
            i ? "," : "", r->devices, r->reps, r->t[0], r->t[1],
            r->t[2], v[0] / v[2], v[1] / v[2], r->t[3], r->t[4], r->t[5], v[3] / v[5],
            v[4] / v[5], r->t[6], r->t[7], r->cpu_gather_s, r->cpu_scatter_s,
            r->cpu_memcpy_s, r->cpu_sum_s);
  }
  printf("(the same bytes as one 1 MiB buffer; ratio = daemon / floor over the same "
         "buffers)\n");
  if (bucket_only) {
    printf("(daemon CPU us = the daemon's threads' CPU time per bucket, mean; memcpy / "
           "sum loop CPU us = the rank threads' CPU time in the floor per round, summed "
           "over ranks, mean; --bucket prints no one-request rows nor fixed cost)\n");
    fprintf(f, "\n  ]");
    bench_json_close(f, jname);
    return 0;
  }
  for (int i = 0; i < 3; i++)
    printf("%s%d devices %.1f / %.1f%s", i ? ", " : "(daemon CPU per bucket, gather / "
           "scatter, us: ", smalls[i].devices, smalls[i].cpu_gather_s * 1e6,
           smalls[i].cpu_scatter_s * 1e6, i == 2 ? ")\n" : "");
  for (int i = 0; i < 3; i++)
    printf("%s%d devices %.1f / %.1f%s", i ? ", " : "(the floors' CPU per round, memcpy / "
           "sum loop, us, all rank threads: ", smalls[i].devices,
           smalls[i].cpu_memcpy_s * 1e6, smalls[i].cpu_sum_s * 1e6, i == 2 ? ")\n" : "");
  printf("\nFixed cost of a collective — a gather of %d floats (median of a round of "
         "every rank)\n%3s | %9s %9s %9s\n%3s | %9s %9s %9s\n", TINY_NUMEL, "dev",
         "gather", "harness", "cost", "", "us", "us", "us");
  for (int i = bucket_only ? 2 : 0; i < 3; i++)
    printf("%3d | %9.1f %9.1f %9.1f\n", smalls[i].devices, smalls[i].t[6] * 1e6,
           smalls[i].t[7] * 1e6, (smalls[i].t[6] - smalls[i].t[7]) * 1e6);
  printf("(harness = the rank threads' round with the same copies and no daemon; "
         "cost = gather - harness)\n");
  fprintf(f, "\n  ]");
  bench_json_close(f, jname);
  return 0;
}

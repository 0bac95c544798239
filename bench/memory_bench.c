/* memory_bench.c — what the daemon holds to train a model, against the
 * bound sharding is for (the FSDP-grade memory issue).
 *
 * For models of 8, 16 and 64 flat units of U parameters (fp32, AdamW) over
 * W = 1, 2, 4 ranks, one device per rank (host backend): register every
 * unit, register the optimizer, then run one training iteration through
 * the collective engine in process (per unit: gather on every rank,
 * scatter of the gradients; then the step), and read the devices' peak
 * bytes (the high-water each backend keeps). Compared with
 *   FSDP / ZeRO-3 bound   16*P + 16*U*W   bytes over all ranks: per rank
 *                         the shard, its fp32 gradient shard and Adam's two
 *                         moments (16*P/W) plus ~2 units gathered and ~2
 *                         units of gradient (16*U),
 *   DDP-style replica     16*P*W: every rank holds everything,
 *   node-shared bound     16*P + 4*U*(3*W + 1): the most transient areas
 *                         hold on the host backend (what a job reserves),
 *                         where the W + 1 gathered copies of a unit are
 *                         the node's, read by every local rank, and each
 *                         rank has 2 gradient slots,
 *   the loop's            16*P + 4*U*(W + 1): what they hold for this
 *                         loop, which holds one unit at a time (pool
 *                         slots are made as first leased): one gathered
 *                         copy on the node and a gradient area a rank.
 * Bytes are exact (the engine and the backend are deterministic), so this
 * is the figure the byte-count tests of that issue will assert; times are
 * not measured here. */
#include <inttypes.h>
#include <uv.h>

#include "backend.h"
#include "bench.h"
#include "coll.h"
#include "optreg.h"
#include "optspec.h"
#include "registry.h"

#define UNIT_NUMEL ((uint64_t)1 << 18) /* 1 MiB of fp32 per unit */
#define MAX_UNITS 64

static char err[1024];
static uint64_t answered;

static void on_done(void *ctx, shardd__coll_member *m, uint64_t seq,
                    shardd_err code, const char *msg,
                    const shardd__coll_result *res) {
  if (code != SHARDD_OK)
    bench_die("collective %" PRIu64 " of rank %u: %s: %s\n", seq, m->rank,
              shardd_err_name(code), msg ? msg : "");
  answered++;
}

static void run_until(uv_loop_t *loop, uint64_t n) {
  while (answered < n)
    uv_run(loop, UV_RUN_ONCE);
}

typedef struct {
  int units;
  uint32_t world;
  uint64_t params, peak, peak_transient, fsdp, node, loop, ddp;
} row;

static uint64_t peak_of(shardd__backend *be) {
  uint64_t sum = 0;
  for (int d = 0; d < be->ndevices; d++) {
    shardd__device_info info;
    be->ops->device_info(be, d, &info);
    sum += info.peak_bytes;
  }
  return sum;
}

static void all_ranks(shardd__coll_engine *eng, uv_loop_t *loop,
                      shardd__coll_member *mem, uint32_t world, uint64_t *seq,
                      shardd__coll_args a) {
  ++*seq;
  for (uint32_t r = 0; r < world; r++)
    shardd__coll_submit(eng, &mem[r], *seq, &a);
  run_until(loop, *seq * world);
}

/* transient: the loop FSDP runs (shardd.nn's hooks will): per unit gather
 * then release in forward; gather with its gradient area, scatter (which
 * consumes it), release in backward; then the step. */
static void measure(int units, uint32_t world, int transient, row *out) {
  uv_loop_t loop;
  if (uv_loop_init(&loop) != 0)
    bench_die("uv_loop_init\n");
  shardd__backend *be;
  uint64_t cap = (uint64_t)units * UNIT_NUMEL * 64 + ((uint64_t)64 << 20);
  if (shardd__backend_host_create((int)world, cap, &be, err, sizeof err) != SHARDD_OK)
    bench_die("%s\n", err);
  shardd__registry reg;
  shardd__registry_init(&reg, be);
  shardd__job *job;
  if (shardd__job_get(&reg, "bench", world, 0, &job, err, sizeof err) != SHARDD_OK ||
      shardd__job_set_transient(job, transient, err, sizeof err) != SHARDD_OK)
    bench_die("%s\n", err);
  shardd__coll_engine *eng;
  shardd__coll_config cfg = {.loop = &loop, .reg = &reg, .timeout = 300,
                             .max_pending = 64,
                             .hooks = {.ctx = NULL, .done = on_done}};
  if (shardd__coll_engine_create(&cfg, &eng) != SHARDD_OK)
    bench_die("engine\n");
  shardd__coll_member mem[4];
  for (uint32_t r = 0; r < world; r++)
    mem[r] = (shardd__coll_member){.job = job, .rank = r};

  shardd__buffer *bufs[MAX_UNITS];
  shardd__optspec_ref refs[MAX_UNITS];
  for (int u = 0; u < units; u++) {
    char name[32];
    int created;
    snprintf(name, sizeof name, "layer%d", u);
    if (shardd__buffer_register(&reg, job, name, SHARDD_DTYPE_FP32, UNIT_NUMEL,
                                &bufs[u], &created, err, sizeof err) != SHARDD_OK)
      bench_die("%s\n", err);
    refs[u] = (shardd__optspec_ref){.id = bufs[u]->hdr.id};
  }
  shardd__optspec_group grp = {.refs = refs, .nrefs = (size_t)units};
  shardd__optspec spec = {.name = "adamw", .kind = SHARDD_OPTIM_ADAMW,
                          .groups = &grp, .ngroups = 1};
  shardd__optreg_result res;
  if (shardd__optreg_register(&reg, job, &spec, SHARDD__OPTREG_ATTACH, &res, err,
                              sizeof err) != SHARDD_OK)
    bench_die("optimizer: %s %s\n", err, res.list ? res.list : "");
  free(res.list);

  /* one iteration: forward gathers, backward scatters, the step */
  uint64_t seq = 0;
  answered = 0;
  for (int u = 0; u < units; u++) {
    all_ranks(eng, &loop, mem, world, &seq,
              (shardd__coll_args){.kind = SHARDD__COLL_GATHER,
                                  .target = bufs[u]->hdr.id});
    if (transient)
      for (uint32_t r = 0; r < world; r++)
        shardd__area_return(bufs[u], r, SHARDD__AREA_GATHER);
  }
  for (int u = units - 1; u >= 0; u--) {
    if (transient)
      all_ranks(eng, &loop, mem, world, &seq,
                (shardd__coll_args){.kind = SHARDD__COLL_GATHER,
                                    .target = bufs[u]->hdr.id, .want_grad = 1});
    all_ranks(eng, &loop, mem, world, &seq,
              (shardd__coll_args){.kind = SHARDD__COLL_SCATTER,
                                  .target = bufs[u]->hdr.id,
                                  .op = SHARDD_REDUCE_MEAN});
    if (transient)
      for (uint32_t r = 0; r < world; r++)
        shardd__area_return(bufs[u], r, SHARDD__AREA_GATHER);
  }
  all_ranks(eng, &loop, mem, world, &seq,
            (shardd__coll_args){.kind = SHARDD__COLL_STEP,
                                .target = res.optim->hdr.id});

  uint64_t p = (uint64_t)units * UNIT_NUMEL;
  out->units = units;
  out->world = world;
  out->params = p;
  if (transient)
    out->peak_transient = peak_of(be);
  else
    out->peak = peak_of(be);
  out->fsdp = 16 * p + 16 * UNIT_NUMEL * world;
  out->node = 16 * p + 4 * UNIT_NUMEL * (3 * (uint64_t)world + 1);
  out->loop = 16 * p + 4 * UNIT_NUMEL * ((uint64_t)world + 1);
  out->ddp = 16 * p * world;

  uv_run(&loop, UV_RUN_DEFAULT);
  shardd__coll_job_free(eng, job);
  shardd__coll_engine_stop(eng);
  shardd__coll_engine_destroy(eng);
  shardd__registry_free(&reg);
  be->ops->destroy(be);
  uv_loop_close(&loop);
}

int main(int argc, char **argv) {
  int full = bench_full(argc, argv);
  static const int unit_counts[] = {8, 16, 64};
  static const uint32_t worlds[] = {1, 2, 4};
  row rows[9];
  size_t n = 0;
  printf("\nmemory: fp32 AdamW, units of %.0f MiB, one device per rank (host)\n",
         (double)(UNIT_NUMEL * 4) / MiB);
  printf("%6s %3s %10s %12s %8s %14s %8s %8s %8s %12s %12s %12s\n", "units", "W",
         "params MiB", "resident MiB", "/FSDP", "transient MiB", "/FSDP", "/node",
         "/loop", "FSDP bound", "node bound", "DDP replica");
  for (size_t i = 0; i < sizeof unit_counts / sizeof *unit_counts; i++)
    for (size_t k = 0; k < sizeof worlds / sizeof *worlds; k++) {
      row *r = &rows[n++];
      measure(unit_counts[i], worlds[k], 0, r);
      measure(unit_counts[i], worlds[k], 1, r);
      printf("%6d %3u %10.0f %12.1f %7.2fx %14.1f %7.2fx %7.2fx %7.2fx %12.1f %12.1f %12.1f\n",
             r->units, r->world, (double)(r->params * 4) / MiB,
             (double)r->peak / MiB, (double)r->peak / (double)r->fsdp,
             (double)r->peak_transient / MiB,
             (double)r->peak_transient / (double)r->fsdp,
             (double)r->peak_transient / (double)r->node,
             (double)r->peak_transient / (double)r->loop, (double)r->fsdp / MiB,
             (double)r->node / MiB, (double)r->ddp / MiB);
    }
  FILE *f = bench_json_open("memory", full);
  fprintf(f, ",\"unit_params\":%" PRIu64 ",\"rows\":[", UNIT_NUMEL);
  for (size_t i = 0; i < n; i++)
    fprintf(f, "%s{\"units\":%d,\"world\":%u,\"params\":%" PRIu64
            ",\"peak_bytes\":%" PRIu64 ",\"peak_transient_bytes\":%" PRIu64
            ",\"fsdp_bound_bytes\":%" PRIu64 ",\"node_bound_bytes\":%" PRIu64
            ",\"loop_bytes\":%" PRIu64 ",\"ddp_bytes\":%" PRIu64 "}",
            i ? "," : "", rows[i].units, rows[i].world, rows[i].params,
            rows[i].peak, rows[i].peak_transient, rows[i].fsdp, rows[i].node,
            rows[i].loop, rows[i].ddp);
  fprintf(f, "]");
  bench_json_close(f, "memory");
  return 0;
}

/* optim_bench.c — optimizer step throughput: SGD with momentum, Adam and
 * AdamW on fp32 and bf16 parameters, both as the in-process kernel the
 * daemon runs (backend_host's update: shardd__optim_update, plus the
 * blocked fp32 -> bf16 write-back for a 16-bit parameter) and through the daemon
 * (shardd_step on a 1-rank job), against streaming-memory floors measured
 * in the same run on arrays of the same length.
 *
 * "Effective GB/s" counts the bytes a step must move per element, each
 * array read or written once:
 *   fp32: param r+w 8, grad 4, state r+w 8 per array (SGD-m 1, Adam 2)
 *         -> SGD-m 20 B, Adam/AdamW 28 B
 *   bf16: fp32 master r+w 8, bf16 param write 2, grad 4, state as above
 *         -> SGD-m 22 B, Adam/AdamW 30 B
 * Floor: the better of a STREAM triad (a = b + s*c) and an in-place
 * a = a + s*b, one thread (a step of one shard runs on one thread) and all
 * CPUs (what the machine can do). torch's CPU AdamW is timed on the same
 * sizes by bench/torch_optim.py; bench/summary.py forms those ratios. */
#include <math.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "bench.h"
#include "backend.h"
#include "optim.h"

typedef struct {
  const char *name;
  shardd_optim_kind kind;
  int nstate;
} kind_desc;

static const kind_desc kinds[] = {
    {"sgd-momentum", SHARDD_OPTIM_SGD, 1},
    {"adam", SHARDD_OPTIM_ADAM, 2},
    {"adamw", SHARDD_OPTIM_ADAMW, 2},
};
static const shardd_dtype dtypes[] = {SHARDD_DTYPE_FP32, SHARDD_DTYPE_BF16};

static void hp_for(const kind_desc *k, shardd__hp *hp) {
  shardd__hp_defaults(k->kind, hp);
  if (k->kind == SHARDD_OPTIM_SGD)
    hp->momentum = 0.9;
}

static double bytes_per_elem(const kind_desc *k, shardd_dtype dt) {
  double b = 8.0 + 4.0 + 8.0 * k->nstate;
  return dt == SHARDD_DTYPE_FP32 ? b : b + 2.0;
}

static void fill(float *p, size_t n, float scale) {
  for (size_t i = 0; i < n; i++)
    p[i] = (float)((int)(i % 2001) - 1000) * scale;
}

/* The in-process side of one configuration: arrays and step count. */
typedef struct {
  const kind_desc *k;
  shardd_dtype dt;
  size_t n;
  shardd__hp hp;
  float *p, *g, *st[3];
  uint16_t *p16;
  uint64_t step;
  char *block, *state; /* the two regions behind the arrays */
  shardd__region *rblock, *rstate;
  size_t goff, state_offs[3]; /* of grad in block, of the states in state */
} kstate;

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* The arrays live in host-backend regions (memfd mappings, as in the
 * daemon) laid out as registry.c lays out a 1-rank buffer and its optimizer
 * state: one block [param (dtype) | reduced grad (fp32)] at 4 KiB-aligned
 * offsets, one state region [fp32 master if 16-bit | state arrays] at
 * 64-byte-aligned offsets. Placement matters: on the machine this was
 * written on, the same AdamW kernel ran at half the speed over arrays from
 * separate malloc()s, whose starts differ by 8 KiB modulo 64 MiB. */
static shardd__backend *be;

static char *region(shardd__region **r, size_t bytes) {
  char err[256];
  if (be->ops->alloc(be, 0, bytes, "optim-bench", r, err, sizeof err) != SHARDD_OK)
    bench_die("host backend alloc: %s", err);
  return (*r)->ptr;
}

static void kernel_setup(kstate *s, const kind_desc *k, shardd_dtype dt,
                         size_t n) {
  memset(s, 0, sizeof *s);
  s->k = k;
  s->dt = dt;
  s->n = n;
  s->step = 1;
  hp_for(k, &s->hp);
  size_t esz = shardd_dtype_size(dt);
  size_t goff = align_up(n * esz, 4096);
  s->block = region(&s->rblock, goff + n * 4);
  s->g = (float *)(s->block + goff);
  size_t arr = align_up(n * 4, 64), off = 0;
  int wide = dt != SHARDD_DTYPE_FP32;
  s->state = region(&s->rstate, arr * (size_t)(k->nstate + wide));
  if (wide) {
    s->p16 = (uint16_t *)s->block;
    s->p = (float *)s->state; /* the fp32 master */
    off = arr;
  } else {
    s->p = (float *)s->block;
  }
  s->goff = goff;
  for (int i = 0; i < k->nstate; i++) {
    s->state_offs[i] = off + (size_t)i * arr;
    s->st[i] = (float *)(s->state + off + (size_t)i * arr);
    memset(s->st[i], 0, n * 4);
  }
  fill(s->p, n, 1e-3f);
  fill(s->g, n, 1e-4f);
  if (wide)
    shardd__from_f32(dt, s->p16, s->p, n);
}

/* One step as the daemon runs it: backend_host's update, which for a
 * 16-bit parameter updates the fp32 master and narrows it into the
 * parameter block by block (so the narrowing reads the master from L1). */
static double kernel_step(kstate *s) {
  double t0 = bench_now();
  shardd_err rc = be->ops->update(be, &s->hp, s->step++, s->dt, s->rblock, 0,
                                  s->p16 ? s->rstate : NULL, 0, s->rblock,
                                  s->goff, 1.0f, s->rstate, s->state_offs, s->n);
  double t = bench_now() - t0;
  if (rc != SHARDD_OK)
    bench_die("host update: %s", shardd_strerror(rc));
  return t;
}

static void kernel_free(kstate *s) {
  be->ops->free(be, s->rblock);
  be->ops->free(be, s->rstate);
}

/* The daemon side: a 1-rank buffer and an optimizer over it. */
typedef struct {
  shardd_client_t *c;
  shardd_buffer_info b;
  uint64_t opt;
  char name[64];
} dstate;

static void daemon_setup(dstate *s, shardd_client_t *c, const kind_desc *k,
                         shardd_dtype dt, size_t n) {
  s->c = c;
  snprintf(s->name, sizeof s->name, "%s-%s-%zu", k->name, shardd_dtype_name(dt), n);
  if (shardd_buffer_register(c, s->name, dt, n, &s->b) != SHARDD_OK)
    bench_die("register %s: %s", s->name, shardd_last_error(c));
  if (dt == SHARDD_DTYPE_FP32) {
    fill(s->b.shard, s->b.shard_numel, 1e-3f);
  } else {
    float *tmp = bench_alloc(s->b.shard_numel * 4);
    fill(tmp, s->b.shard_numel, 1e-3f);
    shardd__from_f32(dt, s->b.shard, tmp, s->b.shard_numel);
    free(tmp);
  }
  /* the gradient every step's scatter reduces (1 rank: copied) */
  if (dt == SHARDD_DTYPE_FP32) {
    fill(s->b.grad, s->b.padded_numel, 1e-4f);
  } else {
    float *tmp = bench_alloc(s->b.padded_numel * 4);
    fill(tmp, s->b.padded_numel, 1e-4f);
    shardd__from_f32(dt, s->b.grad, tmp, s->b.padded_numel);
    free(tmp);
  }
  shardd__hp hp;
  hp_for(k, &hp);
  shardd_hparams h = {.set = SHARDD_HP_LR, .lr = hp.lr};
  if (k->kind == SHARDD_OPTIM_SGD) {
    h.set |= SHARDD_HP_MOMENTUM;
    h.momentum = hp.momentum;
  }
  shardd_param_ref ref = {s->b.id, s->name};
  shardd_param_group g = {&ref, 1, {0}};
  if (shardd_optimizer_register(c, s->name, k->kind, &h, &g, 1, &s->opt) !=
      SHARDD_OK)
    bench_die("optimizer %s: %s", s->name, shardd_last_error(c));
}

static double daemon_step(dstate *s) {
  /* a new gradient, untimed: a step consumes its gradient, and one with
   * none since the last skips the buffer (torch: .grad is None), so without
   * this every timed step after the first measured nothing */
  if (shardd_scatter(s->c, s->b.id, SHARDD_REDUCE_SUM) != SHARDD_OK)
    bench_die("scatter %s: %s", s->name, shardd_last_error(s->c));
  double t0 = bench_now();
  if (shardd_step(s->c, s->opt, NULL, NULL) != SHARDD_OK)
    bench_die("step %s: %s", s->name, shardd_last_error(s->c));
  return bench_now() - t0;
}

static void daemon_free(dstate *s) {
  if (shardd_optimizer_unregister(s->c, s->opt) != SHARDD_OK ||
      shardd_buffer_unregister(s->c, s->b.id) != SHARDD_OK)
    bench_die("unregister %s: %s", s->name, shardd_last_error(s->c));
}

/* ---- crash consistency: the fd store's cost on a step -------------------

 * The same AdamW steps (fp32, 1 rank) through two daemons started alike,
 * one of them with a file descriptor store ($NOTIFY_SOCKET and $FDSTORE, a
 * datagram socket this process drains, closing what it receives): there
 * every step sets its journal record before its first update, commits its
 * step counts into the journal after its last and clears the record (the
 * job's description, its manifest and regions, is rewritten only when the
 * job changed). Two shapes: one buffer of n elements, and a model's: nbuf
 * buffers of n / nbuf elements under one optimizer (the description grows
 * with the buffers, the step with the elements). Steps alternate between
 * the daemons; the ratio is the median of the per-repetition ratios. */
typedef struct {
  int fd;
  volatile int stop;
} notify_drain;

static void *drain_notify(void *arg) {
  notify_drain *nd = arg;
  char buf[4096];
  union {
    char b[CMSG_SPACE(64 * sizeof(int))];
    struct cmsghdr align;
  } ctl;
  while (!nd->stop) {
    struct iovec iov = {buf, sizeof buf};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.b;
    mh.msg_controllen = sizeof ctl.b;
    if (recvmsg(nd->fd, &mh, MSG_CMSG_CLOEXEC) < 0)
      continue; /* the receive timeout: look at stop again */
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
        int *fds = (int *)CMSG_DATA(cm);
        size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++)
          close(fds[i]);
      }
  }
  return NULL;
}

typedef struct {
  shardd_buffer_info *b;
  int nbuf;
  uint64_t opt;
  shardd_client_t *c;
} mstate;

static void model_setup(mstate *s, shardd_client_t *c, size_t n, int nbuf) {
  s->c = c;
  s->nbuf = nbuf;
  s->b = calloc((size_t)nbuf, sizeof *s->b);
  shardd_param_ref *refs = calloc((size_t)nbuf, sizeof *refs);
  char (*names)[32] = calloc((size_t)nbuf, sizeof *names);
  for (int i = 0; i < nbuf; i++) {
    snprintf(names[i], sizeof names[i], "p%d", i);
    if (shardd_buffer_register(c, names[i], SHARDD_DTYPE_FP32, n / (size_t)nbuf,
                               &s->b[i]) != SHARDD_OK)
      bench_die("register %s: %s", names[i], shardd_last_error(c));
    fill(s->b[i].shard, s->b[i].shard_numel, 1e-3f);
    fill(s->b[i].reduced, s->b[i].shard_numel, 1e-4f);
    refs[i] = (shardd_param_ref){s->b[i].id, names[i]};
  }
  shardd_hparams h = {.set = SHARDD_HP_LR, .lr = 1e-3};
  shardd_param_group g = {refs, (size_t)nbuf, {0}};
  if (shardd_optimizer_register(c, "adamw", SHARDD_OPTIM_ADAMW, &h, &g, 1,
                                &s->opt) != SHARDD_OK)
    bench_die("optimizer: %s", shardd_last_error(c));
  free(refs);
  free(names);
}

static double model_step(mstate *s) {
  /* a new gradient in every buffer, untimed: a step without one since the
   * last skips the buffer (torch: .grad is None after zero_grad) */
  for (int i = 0; i < s->nbuf; i++)
    if (shardd_scatter(s->c, s->b[i].id, SHARDD_REDUCE_SUM) != SHARDD_OK)
      bench_die("scatter: %s", shardd_last_error(s->c));
  double t0 = bench_now();
  if (shardd_step(s->c, s->opt, NULL, NULL) != SHARDD_OK)
    bench_die("step: %s", shardd_last_error(s->c));
  return bench_now() - t0;
}

typedef struct {
  size_t n;
  int nbuf;
  double plain_s, store_s, ratio;
} crash_row;

static int crash_bench(const size_t *sizes, int nsizes, const char *devmem,
                       crash_row *rows) {
  char path[108];
  snprintf(path, sizeof path, "/tmp/shardd-bench-notify-%d", (int)getpid());
  unlink(path);
  notify_drain nd = {socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0), 0};
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  struct timeval tv = {0, 100000};
  if (nd.fd < 0 || bind(nd.fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
      setsockopt(nd.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0)
    bench_die("notify socket %s: %s", path, strerror(errno));
  pthread_t th;
  pthread_create(&th, NULL, drain_notify, &nd);
  bench_daemon plain, store;
  bench_daemon_start(&plain, 1, devmem);
  setenv("NOTIFY_SOCKET", path, 1);
  setenv("FDSTORE", "65536", 1);
  bench_daemon_start(&store, 1, devmem);
  unsetenv("NOTIFY_SOCKET");
  unsetenv("FDSTORE");
  int nrows = 0;
  static const int shapes[] = {1, 64};
  for (int si = 0; si < nsizes; si++)
    for (int sh = 0; sh < 2; sh++) {
      size_t n = sizes[si];
      char job[64];
      snprintf(job, sizeof job, "crash-%zu-%d", n, shapes[sh]);
      shardd_client_t *c0 = bench_connect(&plain, job, 0, 1);
      shardd_client_t *c1 = bench_connect(&store, job, 0, 1);
      mstate m0, m1;
      model_setup(&m0, c0, n, shapes[sh]);
      model_setup(&m1, c1, n, shapes[sh]);
      int reps = (int)(1.5e9 / ((double)n * 28.0));
      reps = reps < 9 ? 9 : reps > 60 ? 60 : reps;
      double *t0 = calloc((size_t)reps, sizeof *t0),
             *t1 = calloc((size_t)reps, sizeof *t1),
             *r = calloc((size_t)reps, sizeof *r);
      for (int w = 0; w < 2; w++) {
        model_step(&m0);
        model_step(&m1);
      }
      for (int k = 0; k < reps; k++) {
        /* the order alternates too: neither runs always on a warm cache */
        if (k % 2) {
          t1[k] = model_step(&m1);
          t0[k] = model_step(&m0);
        } else {
          t0[k] = model_step(&m0);
          t1[k] = model_step(&m1);
        }
        r[k] = t1[k] / t0[k];
      }
      rows[nrows++] = (crash_row){n, shapes[sh], bench_median(t0, (size_t)reps),
                                  bench_median(t1, (size_t)reps),
                                  bench_median(r, (size_t)reps)};
      free(t0);
      free(t1);
      free(r);
      free(m0.b);
      free(m1.b);
      shardd_close(c0);
      shardd_close(c1);
      /* its memory back before the next shape's */
      const bench_daemon *ds[2] = {&plain, &store};
      for (int k = 0; k < 2; k++) {
        shardd_client_t *ctl = bench_connect(ds[k], NULL, 0, 0);
        for (int tries = 0; tries < 100 &&
                            shardd_release_job(ctl, job, NULL, NULL) == SHARDD_E_BUSY;
             tries++)
          usleep(10000);
        shardd_close(ctl);
      }
    }
  bench_daemon_stop(&plain);
  bench_daemon_stop(&store);
  nd.stop = 1;
  pthread_join(th, NULL);
  close(nd.fd);
  unlink(path);
  return nrows;
}

/* The crash-consistency rows, printed and (f not NULL) into the JSON. */
static void print_crash_rows(const crash_row *crows, int ncrows, FILE *f) {
  printf("\nCrash consistency (the fd store: journal record + step counts per "
         "step), AdamW fp32 through the daemon:\n");
  printf("%9s %8s | %10s %10s %7s\n", "elements", "buffers", "plain ms",
         "store ms", "ratio");
  if (f)
    fprintf(f, ",\n  \"crash_rows\": [");
  for (int i = 0; i < ncrows; i++) {
    printf("%9zu %8d | %10.3f %10.3f %6.3fx\n", crows[i].n, crows[i].nbuf,
           crows[i].plain_s * 1e3, crows[i].store_s * 1e3, crows[i].ratio);
    if (f)
      fprintf(f, "%s\n    {\"optimizer\": \"adamw\", \"dtype\": \"fp32\", "
                 "\"numel\": %zu, \"buffers\": %d, \"plain_step_s\": %.6g, "
                 "\"fdstore_step_s\": %.6g, \"ratio\": %.4f}",
              i ? "," : "", crows[i].n, crows[i].nbuf, crows[i].plain_s,
              crows[i].store_s, crows[i].ratio);
  }
  printf("(ratio: median of per-repetition fd-store / plain step times; target <= 1.10)\n");
}

/* The same kernel step on each instruction-set path this machine runs
 * (shardd__optim_use_isa), AdamW fp32 and bf16 at n elements, each paired
 * per repetition with the 1-thread floor as the main table is. The main
 * table runs the path the dispatch picks. */
typedef struct {
  shardd__isa isa;
  shardd_dtype dt;
  double step_s, ratio_1t;
} isa_row;

static int isa_compare(size_t n, int reps, isa_row *rows) {
  const kind_desc *k = &kinds[2];
  float *fa3 = bench_floor_arrays(n);
  float *A = fa3, *B = fa3 + n, *C = fa3 + 2 * n;
  double *ts = calloc((size_t)reps, sizeof(double));
  double *rs = calloc((size_t)reps, sizeof(double));
  shardd__isa chosen = shardd__optim_isa();
  int nr = 0;
  for (int di = 0; di < 2; di++)
    for (int i = 0; i < SHARDD__ISA_COUNT; i++) {
      if (shardd__optim_use_isa((shardd__isa)i) != SHARDD_OK)
        continue; /* not runnable here */
      kstate ks;
      kernel_setup(&ks, k, dtypes[di], n);
      kernel_step(&ks);
      for (int r = 0; r < reps; r++) {
        ts[r] = kernel_step(&ks);
        double fl = fmax(bench_floor_on(FLOOR_TRIAD, A, B, C, n, 1, 1),
                         bench_floor_on(FLOOR_RMW, A, B, C, n, 1, 1));
        rs[r] = bytes_per_elem(k, dtypes[di]) * (double)n / GB / ts[r] / fl;
      }
      kernel_free(&ks);
      rows[nr++] = (isa_row){(shardd__isa)i, dtypes[di],
                             bench_median(ts, (size_t)reps),
                             bench_median(rs, (size_t)reps)};
    }
  shardd__optim_use_isa(chosen);
  free(ts);
  free(rs);
  free(fa3);
  return nr;
}

typedef struct {
  size_t n;
  double copy1;
} floor_t;

int main(int argc, char **argv) {
  int full = bench_full(argc, argv);
  static const size_t sizes_short[] = {(size_t)1 << 18, (size_t)1 << 24};
  static const size_t sizes_full[] = {(size_t)1 << 18, (size_t)1 << 22,
                                      (size_t)1 << 24, (size_t)1 << 26};
  const size_t *sizes = full ? sizes_full : sizes_short;
  int nsizes = full ? 4 : 2;
  long ncpu = bench_ncpu();
  size_t maxn = sizes[nsizes - 1];
  char devmem[32];
  snprintf(devmem, sizeof devmem, "%.0fM", 36.0 * (double)maxn / MiB + 64);
  /* --crash: only the crash-consistency rows, printed (no JSON): what a
   * change to the fd store is measured with, before and after */
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--crash") == 0) {
      crash_row rows[8];
      int nr = crash_bench(sizes, nsizes < 4 ? nsizes : 4, devmem, rows);
      print_crash_rows(rows, nr, NULL);
      return 0;
    }
  bench_daemon d;
  bench_daemon_start(&d, 1, devmem);
  shardd_client_t *c = bench_connect(&d, "optim-bench", 0, 1);
  char err[256];
  if (shardd__backend_host_create(1, 0, &be, err, sizeof err) != SHARDD_OK)
    bench_die("host backend: %s", err);

  int nk = 3, nd = 2;
  /* per size, kind, dtype: median step seconds and median floors */
  double kt[4][3][2], dtm[4][3][2], f1[4][3][2], fa[4][3][2];
  /* medians of the per-repetition ratios (kernel or daemon / floor), paired
   * so that a slow spell on the machine divides out */
  double rk1[4][3][2], rka[4][3][2], rd1[4][3][2], rda[4][3][2];
  floor_t fl[4];
  int reps_of[4];
  for (int si = 0; si < nsizes; si++) {
    size_t n = sizes[si];
    int reps = (int)((full ? 6e9 : 1.5e9) / ((double)n * 28.0));
    reps = reps < 5 ? 5 : reps > 40 ? 40 : reps;
    reps_of[si] = reps;
    float *fa3 = bench_floor_arrays(n);
    float *A = fa3, *B = fa3 + n, *C = fa3 + 2 * n;
    fl[si] = (floor_t){n, bench_floor_on(FLOOR_COPY, A, B, C, n, 1, 5)};
    double *t[8];
    for (int j = 0; j < 8; j++)
      t[j] = calloc((size_t)reps, sizeof(double));
    for (int ki = 0; ki < nk; ki++)
      for (int di = 0; di < nd; di++) {
        kstate ks;
        dstate ds;
        kernel_setup(&ks, &kinds[ki], dtypes[di], n);
        daemon_setup(&ds, c, &kinds[ki], dtypes[di], n);
        for (int w = 0; w < 2; w++) { /* warm-up: SGD's first step differs */
          kernel_step(&ks);
          daemon_step(&ds);
        }
        /* kernel, daemon and floors alternate so that noise from other
         * tenants of the machine falls on all of them */
        for (int r = 0; r < reps; r++) {
          t[0][r] = kernel_step(&ks);
          t[1][r] = daemon_step(&ds);
          t[2][r] = fmax(bench_floor_on(FLOOR_TRIAD, A, B, C, n, 1, 1),
                         bench_floor_on(FLOOR_RMW, A, B, C, n, 1, 1));
          t[3][r] = fmax(bench_floor_on(FLOOR_TRIAD, A, B, C, n, (int)ncpu, 1),
                         bench_floor_on(FLOOR_RMW, A, B, C, n, (int)ncpu, 1));
          double bpe = bytes_per_elem(&kinds[ki], dtypes[di]) * (double)n / GB;
          t[4][r] = bpe / t[0][r] / t[2][r];
          t[5][r] = bpe / t[0][r] / t[3][r];
          t[6][r] = bpe / t[1][r] / t[2][r];
          t[7][r] = bpe / t[1][r] / t[3][r];
        }
        rk1[si][ki][di] = bench_median(t[4], (size_t)reps);
        rka[si][ki][di] = bench_median(t[5], (size_t)reps);
        rd1[si][ki][di] = bench_median(t[6], (size_t)reps);
        rda[si][ki][di] = bench_median(t[7], (size_t)reps);
        kt[si][ki][di] = bench_median(t[0], (size_t)reps);
        dtm[si][ki][di] = bench_median(t[1], (size_t)reps);
        f1[si][ki][di] = bench_median(t[2], (size_t)reps);
        fa[si][ki][di] = bench_median(t[3], (size_t)reps);
        daemon_free(&ds);
        kernel_free(&ks);
      }
    for (int j = 0; j < 8; j++)
      free(t[j]);
    free(fa3);
  }
  shardd_close(c);
  bench_daemon_stop(&d);
  isa_row irows[2 * SHARDD__ISA_COUNT];
  int nirows = isa_compare(maxn, reps_of[nsizes - 1], irows);
  crash_row crows[8];
  int ncrows = crash_bench(sizes, nsizes < 4 ? nsizes : 4, devmem, crows);
  be->ops->destroy(be);

  char cpu[256];
  bench_cpu_model(cpu, sizeof cpu);
  printf("\nOptimizer step — %s (%ld CPUs); one shard = one thread\n", cpu, ncpu);
  FILE *f = bench_json_open("optim", full);
  fprintf(f, ",\n  \"floors\": [");
  for (int si = 0; si < nsizes; si++) {
    floor_t *x = &fl[si];
    double lo1 = 1e30, hi1 = 0, loa = 1e30, hia = 0;
    for (int ki = 0; ki < nk; ki++)
      for (int di = 0; di < nd; di++) {
        lo1 = fmin(lo1, f1[si][ki][di]);
        hi1 = fmax(hi1, f1[si][ki][di]);
        loa = fmin(loa, fa[si][ki][di]);
        hia = fmax(hia, fa[si][ki][di]);
      }
    printf("floor at %zu elements (%.0f MiB fp32): memcpy %.2f GB/s; max(triad, "
           "in-place) %.2f-%.2f GB/s 1 thread, %.2f-%.2f GB/s %ld threads (medians "
           "per row, below)\n",
           x->n, (double)x->n * 4 / MiB, x->copy1, lo1, hi1, loa, hia, ncpu);
    fprintf(f, "%s\n    {\"numel\": %zu, \"memcpy_1t_GBps\": %.4g, "
               "\"floor_1t_GBps_min\": %.4g, \"floor_1t_GBps_max\": %.4g, "
               "\"floor_all_GBps_min\": %.4g, \"floor_all_GBps_max\": %.4g, "
               "\"threads_all\": %ld}",
            si ? "," : "", x->n, x->copy1, lo1, hi1, loa, hia, ncpu);
  }
  fprintf(f, "\n  ],\n  \"rows\": [");
  printf("%-12s %4s %9s %7s | %8s %7s %6s %6s | %8s %7s %6s %6s\n", "", "", "", "",
         "kernel", "", "/floor", "/floor", "daemon", "", "/floor", "/floor");
  printf("%-12s %4s %9s %7s | %8s %7s %6s %6s | %8s %7s %6s %6s\n", "optimizer",
         "type", "elements", "B/elem", "Melem/s", "GB/s", "1 thr", "all", "Melem/s",
         "GB/s", "1 thr", "all");
  int first = 1;
  for (int si = 0; si < nsizes; si++)
    for (int ki = 0; ki < nk; ki++)
      for (int di = 0; di < nd; di++) {
        size_t n = sizes[si];
        double bpe = bytes_per_elem(&kinds[ki], dtypes[di]);
        double fl1 = f1[si][ki][di], fla = fa[si][ki][di];
        double ke = (double)n / kt[si][ki][di], de = (double)n / dtm[si][ki][di];
        double kg = ke * bpe / GB, dg = de * bpe / GB;
        char ne[32];
        snprintf(ne, sizeof ne, "%zuM", n >> 20);
        if (n < ((size_t)1 << 20))
          snprintf(ne, sizeof ne, "%zuK", n >> 10);
        printf("%-12s %4s %9s %7.0f | %8.1f %7.2f %5.2fx %5.2fx | %8.1f %7.2f %5.2fx "
               "%5.2fx\n",
               kinds[ki].name, shardd_dtype_name(dtypes[di]), ne, bpe, ke / 1e6, kg,
               rk1[si][ki][di], rka[si][ki][di], de / 1e6, dg, rd1[si][ki][di],
               rda[si][ki][di]);
        const char *path[2] = {"kernel", "daemon"};
        double secs[2] = {kt[si][ki][di], dtm[si][ki][di]};
        double r1[2] = {rk1[si][ki][di], rd1[si][ki][di]};
        double ra[2] = {rka[si][ki][di], rda[si][ki][di]};
        for (int pi = 0; pi < 2; pi++) {
          double el = (double)n / secs[pi], gb = el * bpe / GB;
          fprintf(f, "%s\n    {\"optimizer\": \"%s\", \"dtype\": \"%s\", \"numel\": %zu, "
                     "\"path\": \"%s\", \"reps\": %d, \"step_s\": %.6g, "
                     "\"elements_per_s\": %.6g, \"bytes_per_element\": %.0f, "
                     "\"effective_GBps\": %.4g, \"floor_1t_GBps\": %.4g, "
                     "\"floor_all_GBps\": %.4g, \"ratio_floor_1t\": %.4f, "
                     "\"ratio_floor_all\": %.4f}",
                  first ? "" : ",", kinds[ki].name, shardd_dtype_name(dtypes[di]), n,
                  path[pi], reps_of[si], secs[pi], el, bpe, gb, fl1, fla, r1[pi],
                  ra[pi]);
          first = 0;
        }
      }
  printf("(kernel = the host backend's update in this process; daemon = shardd_step, 1 rank,\n"
         " including the round trip; floor = max(triad, in-place) at the same length,\n"
         " measured between steps; /floor = median of the per-repetition ratios)\n");
  fprintf(f, "\n  ]");
  printf("\nAdamW kernel per instruction-set path, %zuM elements (dispatch picks %s):\n",
         maxn >> 20, shardd__isa_name(shardd__optim_isa()));
  printf("%-8s %4s | %8s %7s %6s\n", "path", "type", "Melem/s", "GB/s", "1 thr");
  fprintf(f, ",\n  \"isa_chosen\": \"%s\",\n  \"isa_rows\": [",
          shardd__isa_name(shardd__optim_isa()));
  for (int i = 0; i < nirows; i++) {
    double el = (double)maxn / irows[i].step_s;
    double gb = el * bytes_per_elem(&kinds[2], irows[i].dt) / GB;
    printf("%-8s %4s | %8.1f %7.2f %5.2fx\n", shardd__isa_name(irows[i].isa),
           shardd_dtype_name(irows[i].dt), el / 1e6, gb, irows[i].ratio_1t);
    fprintf(f, "%s\n    {\"optimizer\": \"adamw\", \"isa\": \"%s\", \"dtype\": \"%s\", "
               "\"numel\": %zu, \"step_s\": %.6g, \"effective_GBps\": %.4g, "
               "\"ratio_floor_1t\": %.4f}",
            i ? "," : "", shardd__isa_name(irows[i].isa), shardd_dtype_name(irows[i].dt),
            maxn, irows[i].step_s, gb, irows[i].ratio_1t);
  }
  fprintf(f, "\n  ]");
  print_crash_rows(crows, ncrows, f);
  fprintf(f, "\n  ]");
  bench_json_close(f, "optim");
  return 0;
}

/* registry_bench.c — time to register 10,000 flat buffers and 100,000 views
 * (10 per buffer) and to validate an optimizer over them, both styles: the
 * 100,000 views (use_orig_params) and the 10,000 whole buffers (FSDP1).
 *
 * In process: the registry and validate APIs on a host backend, as the
 * daemon's loop thread calls them (each buffer is one memfd region, 4 KiB
 * per area). Through the daemon: the same over one libshardd connection,
 * including a registration refused for one stray ref (validation only, the
 * whole list is checked and reported) and the accepted one (validation plus
 * optimizer state); then another 100,000 views of the same buffers in one
 * shardd_views_register call (requests of 4096) and their unregistration
 * in one shardd_views_unregister call, while a second connection pings
 * the daemon: the longest ping is how long a batch holds the loop from
 * other clients. FULL=1 repeats the in-process run more often. */
#include <sys/resource.h>

#include "bench.h"
#include "optcodec.h"
#include "proto/shardd.pb-c.h"
#include "registry.h"
#include "validate.h"

#define NBUF 10000
#define VPB 10 /* views per buffer */
#define NVIEW (NBUF * VPB)
#define VNUMEL 64

static char err[1024];

/* Optimizer request over refs[0..n) in one group. */
typedef struct {
  Shardwire__RegisterOptimizer req;
  Shardwire__ParamGroup grp, *grpp;
  Shardwire__ParamRef *refs, **refp;
} opt_req;

static void opt_req_init(opt_req *o, const uint64_t *ids, char **names,
                         size_t n) {
  shardwire__register_optimizer__init(&o->req);
  shardwire__param_group__init(&o->grp);
  o->refs = calloc(n, sizeof *o->refs);
  o->refp = calloc(n, sizeof *o->refp);
  for (size_t i = 0; i < n; i++) {
    shardwire__param_ref__init(&o->refs[i]);
    o->refs[i].id = ids[i];
    o->refs[i].name = names[i];
    o->refp[i] = &o->refs[i];
  }
  o->grp.n_refs = n;
  o->grp.refs = o->refp;
  o->grpp = &o->grp;
  o->req.name = "bench";
  o->req.kind = SHARDWIRE__OPTIM_KIND__ADAMW;
  o->req.n_groups = 1;
  o->req.groups = &o->grpp;
}

static void opt_req_free(opt_req *o) {
  free(o->refs);
  free(o->refp);
}

enum { T_BUF, T_VIEW, T_VAL_VIEWS, T_VAL_BUFS, T_CREATE, T_FREE, NT };
static const char *tname[NT] = {
    "register 10,000 buffers",           "register 100,000 views",
    "validate 100,000 view refs",        "validate 10,000 buffer refs",
    "create optimizer (100,000 views)",  "release everything"};

static char *bnames[NBUF], *vnames[NVIEW];

/* One in-process run; times in t[NT]; *create_err set if creation failed. */
static void run_inproc(double *t, char *create_err, size_t cel) {
  shardd__backend *be;
  if (shardd__backend_host_create(1, 0, &be, err, sizeof err) != SHARDD_OK)
    bench_die("backend: %s", err);
  shardd__registry reg;
  shardd__registry_init(&reg, be);
  shardd__job *job;
  if (shardd__job_get(&reg, "bench", 1, (uint32_t)getuid(), &job, err, sizeof err))
    bench_die("job: %s", err);
  static uint64_t bid[NBUF], vid[NVIEW];
  static shardd__buffer *bufs[NBUF];
  int created;
  double t0 = bench_now();
  for (int i = 0; i < NBUF; i++) {
    if (shardd__buffer_register(&reg, job, bnames[i], SHARDD_DTYPE_FP32,
                                VPB * VNUMEL, &bufs[i], &created, err,
                                sizeof err) != SHARDD_OK)
      bench_die("buffer %d: %s", i, err);
    bid[i] = bufs[i]->hdr.id;
  }
  double t1 = bench_now();
  int64_t shape[2] = {8, 8};
  for (int i = 0; i < NBUF; i++)
    for (int j = 0; j < VPB; j++) {
      shardd__view *v;
      if (shardd__view_register(&reg, job, bid[i], vnames[i * VPB + j],
                                (uint64_t)j * VNUMEL, VNUMEL, shape, 2, &v,
                                &created, err, sizeof err) != SHARDD_OK)
        bench_die("view: %s", err);
      vid[i * VPB + j] = v->hdr.id;
    }
  double t2 = bench_now();
  opt_req ov, ob;
  opt_req_init(&ov, vid, vnames, NVIEW);
  opt_req_init(&ob, bid, bnames, NBUF);
  shardd__optim_plan plan_v, plan_b;
  char *msg = NULL;
  /* converted as the daemon does, outside the timing of validation */
  shardd__optspec spec_v, spec_b;
  if (shardd__optspec_from_wire(&ov.req, &spec_v) != SHARDD_OK ||
      shardd__optspec_from_wire(&ob.req, &spec_b) != SHARDD_OK)
    bench_die("optspec: out of memory");
  double t3 = bench_now();
  if (shardd__validate_optimizer(&reg, job, &spec_v, &plan_v, &msg) != SHARDD_OK)
    bench_die("validate views: %s", msg);
  double t4 = bench_now();
  if (shardd__validate_optimizer(&reg, job, &spec_b, &plan_b, &msg) != SHARDD_OK)
    bench_die("validate buffers: %s", msg);
  double t5 = bench_now();
  shardd__optspec_free(&spec_v);
  shardd__optspec_free(&spec_b);
  shardd__optim_plan_free(&plan_b);
  shardd__optim *o;
  create_err[0] = '\0';
  double t6 = bench_now();
  if (shardd__optim_create(&reg, job, &plan_v, &o, err, sizeof err) != SHARDD_OK)
    snprintf(create_err, cel, "%s", err);
  double t7 = bench_now();
  shardd__optim_plan_free(&plan_v);
  opt_req_free(&ov);
  opt_req_free(&ob);
  double t8 = bench_now();
  shardd__registry_free(&reg);
  double t9 = bench_now();
  be->ops->destroy(be);
  t[T_BUF] = t1 - t0;
  t[T_VIEW] = t2 - t1;
  t[T_VAL_VIEWS] = t4 - t3;
  t[T_VAL_BUFS] = t5 - t4;
  t[T_CREATE] = t7 - t6;
  t[T_FREE] = t9 - t8;
}

enum { D_BUF, D_VIEW, D_REFUSED, D_ACCEPT, D_VIEW_BATCH, D_UNREG_BATCH,
       D_BUF_BATCH, D_BUF_UNREG_BATCH, ND };
static const char *dname[ND] = {
    "register 10,000 buffers (+ mmap)", "register 100,000 views",
    "optimizer refused (1 stray ref)", "optimizer accepted (100,000 views)",
    "register 100,000 views (batched)", "unregister 100,000 views (batched)",
    "register 10,000 buffers (batched, + mmap)",
    "unregister 10,000 buffers (batched)"};

static char *bbnames[NBUF]; /* the batch's buffers */

static char *bvnames[NVIEW]; /* the batch's views */

/* A second client's pings while the batches run. */
typedef struct {
  shardd_client_t *c;
  volatile int stop;
  double max_s, sum_s;
  long n;
} pinger;

static void *ping_main(void *p) {
  pinger *pg = p;
  while (!pg->stop) {
    double t0 = bench_now();
    if (shardd_ping(pg->c) != SHARDD_OK)
      bench_die("ping: %s", shardd_last_error(pg->c));
    double dt = bench_now() - t0;
    if (dt > pg->max_s)
      pg->max_s = dt;
    pg->sum_s += dt;
    pg->n++;
  }
  return NULL;
}

static double ping_max_ms, ping_mean_us, idle_ping_max_ms, idle_ping_mean_us;
static long ping_count;

static void run_daemon(double *t, char *accept_err, size_t ael, char *refuse_msg,
                       size_t rml) {
  bench_daemon d;
  bench_daemon_start(&d, 1, "8G");
  shardd_client_t *c = bench_connect(&d, "registry-bench", 0, 1);
  static uint64_t bid[NBUF];
  shardd_param_ref *refs = calloc(NVIEW + 1, sizeof *refs);
  double tb, tub;
  /* 10,000 buffers in one call (mapped, as the one-by-one ones below),
   * then unregistered in one: first, as the daemon's descriptors hold
   * 20,000 regions at most and the one-by-one ones stay for the views */
  shardd_buffer_spec *bs = calloc(NBUF, sizeof *bs);
  shardd_buffer_info *binfo = calloc(NBUF, sizeof *binfo);
  uint64_t *bids = calloc(NBUF, sizeof *bids);
  if (bs == NULL || binfo == NULL || bids == NULL)
    bench_die("out of memory");
  for (int i = 0; i < NBUF; i++) {
    shardd_buffer_spec e = SHARDD_BUFFER_SPEC_INIT;
    e.name = bbnames[i];
    e.dtype = SHARDD_DTYPE_FP32;
    e.numel = VPB * VNUMEL;
    bs[i] = e;
  }
  double b0 = bench_now();
  if (shardd_buffers_register(c, NBUF, bs, binfo, NULL) != SHARDD_OK)
    bench_die("buffers batch: %s", shardd_last_error(c));
  double b1 = bench_now();
  for (int i = 0; i < NBUF; i++)
    bids[i] = binfo[i].id;
  double b2 = bench_now();
  if (shardd_buffers_unregister(c, NBUF, bids, NULL, NULL) != SHARDD_OK)
    bench_die("buffers unregister batch: %s", shardd_last_error(c));
  double b3 = bench_now();
  tb = b1 - b0;
  tub = b3 - b2;
  free(bs);
  free(binfo);
  free(bids);
  double t0 = bench_now();
  for (int i = 0; i < NBUF; i++) {
    shardd_buffer_info b;
    if (shardd_buffer_register(c, bnames[i], SHARDD_DTYPE_FP32, VPB * VNUMEL, &b))
      bench_die("buffer %d: %s", i, shardd_last_error(c));
    bid[i] = b.id;
  }
  double t1 = bench_now();
  int64_t shape[2] = {8, 8};
  for (int i = 0; i < NBUF; i++)
    for (int j = 0; j < VPB; j++) {
      uint64_t v;
      if (shardd_view_register(c, bid[i], vnames[i * VPB + j],
                               (uint64_t)j * VNUMEL, VNUMEL, shape, 2, &v))
        bench_die("view: %s", shardd_last_error(c));
      refs[i * VPB + j] = (shardd_param_ref){v, vnames[i * VPB + j]};
    }
  double t2 = bench_now();
  /* a stray tensor (id 0) at the end: every ref is checked, then refused */
  refs[NVIEW] = (shardd_param_ref){0, "stray.weight"};
  shardd_param_group g = {refs, NVIEW + 1, {0}};
  shardd_hparams h = {0};
  uint64_t opt;
  shardd_err rc = shardd_optimizer_register(c, "bench", SHARDD_OPTIM_ADAMW, &h,
                                            &g, 1, &opt);
  double t3 = bench_now();
  snprintf(refuse_msg, rml, "%s: %s", shardd_err_name(rc), shardd_last_error(c));
  g.nrefs = NVIEW;
  accept_err[0] = '\0';
  double t4 = bench_now();
  rc = shardd_optimizer_register(c, "bench", SHARDD_OPTIM_ADAMW, &h, &g, 1, &opt);
  double t5 = bench_now();
  if (rc != SHARDD_OK)
    snprintf(accept_err, ael, "%s: %s", shardd_err_name(rc), shardd_last_error(c));
  /* the same number of views again, one call; a ping alone first, for
   * the latency the loop has without a batch */
  shardd_view_spec *specs = calloc(NVIEW, sizeof *specs);
  shardd_view_info *vinfo = calloc(NVIEW, sizeof *vinfo);
  uint64_t *vids = calloc(NVIEW, sizeof *vids);
  if (specs == NULL || vinfo == NULL || vids == NULL)
    bench_die("out of memory");
  for (int i = 0; i < NBUF; i++)
    for (int j = 0; j < VPB; j++) {
      shardd_view_spec e = SHARDD_VIEW_SPEC_INIT;
      e.buffer = bid[i];
      e.name = bvnames[i * VPB + j];
      e.offset = (uint64_t)j * VNUMEL;
      e.numel = VNUMEL;
      e.shape = shape;
      e.ndim = 2;
      specs[i * VPB + j] = e;
    }
  pinger pg = {bench_connect(&d, "registry-bench-ping", 0, 1), 0, 0, 0, 0};
  for (int i = 0; i < 2000; i++) {
    double p0 = bench_now();
    if (shardd_ping(pg.c) != SHARDD_OK)
      bench_die("ping: %s", shardd_last_error(pg.c));
    double dp = bench_now() - p0;
    if (dp > idle_ping_max_ms / 1e3)
      idle_ping_max_ms = dp * 1e3;
    idle_ping_mean_us += dp * 1e6 / 2000;
  }
  /* timed alone (the pings would take CPU from it), then again with a
   * second client pinging throughout, for the latency it sees */
  double t6 = 0, t7 = 0, t8 = 0, t9 = 0;
  pthread_t th;
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 1)
      pthread_create(&th, NULL, ping_main, &pg);
    double a = bench_now();
    if (shardd_views_register(c, NVIEW, specs, vinfo, NULL) != SHARDD_OK)
      bench_die("views batch: %s", shardd_last_error(c));
    double z = bench_now();
    for (int i = 0; i < NVIEW; i++)
      vids[i] = vinfo[i].id;
    double u0 = bench_now();
    if (shardd_views_unregister(c, NVIEW, vids, NULL, NULL) != SHARDD_OK)
      bench_die("unregister batch: %s", shardd_last_error(c));
    double u1 = bench_now();
    if (pass == 0) {
      t6 = a;
      t7 = z;
      t8 = u0;
      t9 = u1;
    }
  }
  pg.stop = 1;
  pthread_join(th, NULL);
  ping_max_ms = pg.max_s * 1e3;
  ping_mean_us = pg.n ? pg.sum_s / (double)pg.n * 1e6 : 0;
  ping_count = pg.n;
  shardd_close(pg.c);
  free(specs);
  free(vinfo);
  free(vids);
  t[D_BUF] = t1 - t0;
  t[D_VIEW] = t2 - t1;
  t[D_REFUSED] = t3 - t2;
  t[D_ACCEPT] = t5 - t4;
  t[D_VIEW_BATCH] = t7 - t6;
  t[D_UNREG_BATCH] = t9 - t8;
  t[D_BUF_BATCH] = tb;
  t[D_BUF_UNREG_BATCH] = tub;
  shardd_close(c);
  free(refs);
  bench_daemon_stop(&d);
}

int main(int argc, char **argv) {
  int full = bench_full(argc, argv);
  int reps = full ? 7 : 3;
  /* every region is one memfd: let this process (and the daemon, which
   * inherits it) open as many as the hard limit allows */
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  for (int i = 0; i < NBUF; i++) {
    char s[64];
    snprintf(s, sizeof s, "layer%d.flat", i);
    bnames[i] = strdup(s);
    snprintf(s, sizeof s, "layer%d.batched", i);
    bbnames[i] = strdup(s);
    for (int j = 0; j < VPB; j++) {
      snprintf(s, sizeof s, "layer%d.param%d.weight", i, j);
      vnames[i * VPB + j] = strdup(s);
      snprintf(s, sizeof s, "layer%d.param%d.batched", i, j);
      bvnames[i * VPB + j] = strdup(s);
    }
  }
  double tin[NT][16];
  char create_err[1024] = "";
  for (int r = 0; r < reps; r++) {
    double t[NT];
    run_inproc(t, create_err, sizeof create_err);
    for (int k = 0; k < NT; k++)
      tin[k][r] = t[k];
  }
  double td[ND];
  char accept_err[1024], refuse_msg[4096];
  run_daemon(td, accept_err, sizeof accept_err, refuse_msg, sizeof refuse_msg);

  char cpu[256];
  bench_cpu_model(cpu, sizeof cpu);
  printf("\nRegistry — %d buffers, %d views, %s (%ld CPUs); RLIMIT_NOFILE %llu\n",
         NBUF, NVIEW, cpu, bench_ncpu(), (unsigned long long)rl.rlim_cur);
  printf("%-36s %10s %12s\n", "in process (median of runs)", "ms", "us/object");
  static const double per[NT] = {NBUF, NVIEW, NVIEW, NBUF, NVIEW, NBUF + NVIEW};
  FILE *f = bench_json_open("registry", full);
  fprintf(f, ",\n  \"buffers\": %d,\n  \"views\": %d,\n  \"runs\": %d,\n"
             "  \"rlimit_nofile\": %llu,\n  \"in_process_s\": {",
          NBUF, NVIEW, reps, (unsigned long long)rl.rlim_cur);
  for (int k = 0; k < NT; k++) {
    double m = bench_median(tin[k], (size_t)reps);
    printf("%-36s %10.2f %12.3f\n", tname[k], m * 1e3, m / per[k] * 1e6);
    fprintf(f, "%s\n    \"%s\": %.6g", k ? "," : "", tname[k], m);
  }
  if (create_err[0])
    printf("  optimizer creation FAILED: %s\n", create_err);
  fprintf(f, "\n  },\n  \"in_process_create_error\": \"%s\",\n  \"daemon_s\": {",
          create_err);
  printf("%-36s %10s %12s\n", "through the daemon (one run)", "ms", "us/object");
  static const double dper[ND] = {NBUF, NVIEW, NVIEW, NVIEW, NVIEW, NVIEW,
                                  NBUF, NBUF};
  for (int k = 0; k < ND; k++) {
    printf("%-36s %10.2f %12.3f\n", dname[k], td[k] * 1e3, td[k] / dper[k] * 1e6);
    fprintf(f, "%s\n    \"%s\": %.6g", k ? "," : "", dname[k], td[k]);
  }
  printf("  one by one vs batched: %.1fx; another client's pings during the "
         "batches: %ld, mean %.0f us, longest %.2f ms (idle: mean %.0f us, "
         "longest %.2f ms)\n",
         td[D_VIEW] / td[D_VIEW_BATCH], ping_count, ping_mean_us, ping_max_ms,
         idle_ping_mean_us, idle_ping_max_ms);
  fprintf(f, "\n  },\n  \"batch_ping\": {\"count\": %ld, \"mean_s\": %.6g, "
             "\"max_s\": %.6g, \"idle_mean_s\": %.6g, \"idle_max_s\": %.6g}",
          ping_count, ping_mean_us / 1e6, ping_max_ms / 1e3,
          idle_ping_mean_us / 1e6, idle_ping_max_ms / 1e3);
  refuse_msg[strcspn(refuse_msg, "\n")] = '\0';
  printf("  refusal: %.160s\n", refuse_msg);
  if (accept_err[0])
    printf("  accepted registration FAILED: %s\n", accept_err);
  for (char *p = accept_err; *p; p++)
    if (*p == '"' || *p == '\\' || *p == '\n')
      *p = ' ';
  for (char *p = refuse_msg; *p; p++)
    if (*p == '"' || *p == '\\')
      *p = ' ';
  fprintf(f, ",\n  \"daemon_accept_error\": \"%s\",\n  \"daemon_refusal\": \"%.200s\"",
          accept_err, refuse_msg);
  bench_json_close(f, "registry");
  for (int i = 0; i < NBUF; i++) {
    free(bnames[i]);
    free(bbnames[i]);
  }
  for (int i = 0; i < NVIEW; i++) {
    free(vnames[i]);
    free(bvnames[i]);
  }
  return 0;
}

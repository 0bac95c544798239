/* harness_checkpoint.c — what the checkpoint tests share
 * (test_checkpoint.c, test_operator_checkpoints.c,
 * test_checkpoint_while_running.c, test_checkpoint_security.c): a scratch
 * directory and an in-process registry per test (the suite's setup and
 * teardown), a job filled at random and its byte image, and ranks that
 * train a job through a real daemon. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <inttypes.h>
#include <pthread.h>

#include "checkpoint.h"
#include "checkpoint_fixture.h"
#include "harness.h"
#include "manifest.h"
#include "optcodec.h"
#include "proto/shardd.pb-c.h"
#include "registry.h"
#include "validate.h"

char dir[64];

shardd__backend *be;

shardd__registry reg;

void rm_tree(const char *path) {
  DIR *d = opendir(path);
  if (d == NULL)
    return;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
      continue;
    char p[512];
    snprintf(p, sizeof p, "%s/%s", path, e->d_name);
    if (e->d_type == DT_DIR)
      rm_tree(p);
    else
      unlink(p);
  }
  closedir(d);
  rmdir(path);
}

void setup(void) {
  snprintf(dir, sizeof dir, "/tmp/shardd-ckpt-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
  char err[256];
  cr_assert_eq(shardd__backend_host_create(2, 64u << 20, &be, err, sizeof err),
               SHARDD_OK);
  shardd__registry_init(&reg, be);
}

void teardown(void) {
  shardd__registry_free(&reg);
  be->ops->destroy(be);
  rm_tree(dir);
}

uint32_t rng = 12345;

uint32_t next_rand(void) {
  rng = rng * 1664525u + 1013904223u;
  return rng >> 8;
}

void fill_random(void *p, size_t bytes) {
  unsigned char *b = p;
  for (size_t i = 0; i < bytes; i++)
    b[i] = (unsigned char)next_rand();
}

/* A job with an fp32 and a bf16 buffer, views in both, one AdamW over the
 * views and the whole of nothing else; shards and state filled randomly. */
shardd__job *make_job(const char *name) {
  char err[512];
  shardd__job *job;
  cr_assert_eq(shardd__job_get(&reg, name, 3, 0, &job, err, sizeof err), SHARDD_OK);
  shardd__buffer *a, *b;
  int created;
  cr_assert_eq(shardd__buffer_register(&reg, job, "layer 0/weights", SHARDD_DTYPE_FP32,
                                       1001, &a, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(shardd__buffer_register(&reg, job, "emb", SHARDD_DTYPE_BF16, 77, &b,
                                       &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__view *v1, *v2, *v3;
  int64_t s1[2] = {10, 50}, s2[1] = {501}, s3[1] = {77};
  cr_assert_eq(shardd__view_register(&reg, job, a->hdr.id, "w", 0, 500, s1, 2, &v1,
                                     &created, err, sizeof err), SHARDD_OK);
  cr_assert_eq(shardd__view_register(&reg, job, a->hdr.id, "b%ias", 500, 501, s2, 1,
                                     &v2, &created, err, sizeof err), SHARDD_OK);
  cr_assert_eq(shardd__view_register(&reg, job, b->hdr.id, "e", 0, 77, s3, 1, &v3,
                                     &created, err, sizeof err), SHARDD_OK);

  Shardwire__ParamRef r[3], *rp[3];
  uint64_t ids[3] = {v1->hdr.id, v2->hdr.id, v3->hdr.id};
  for (int i = 0; i < 3; i++) {
    shardwire__param_ref__init(&r[i]);
    r[i].id = ids[i];
    rp[i] = &r[i];
  }
  Shardwire__ParamGroup g0 = SHARDWIRE__PARAM_GROUP__INIT, g1 = SHARDWIRE__PARAM_GROUP__INIT;
  Shardwire__HyperParams ov = SHARDWIRE__HYPER_PARAMS__INIT;
  ov.has_amsgrad = 1;
  ov.amsgrad = 1;
  g0.refs = rp;
  g0.n_refs = 2;
  g1.refs = rp + 2;
  g1.n_refs = 1;
  g1.overrides = &ov;
  Shardwire__ParamGroup *gp[2] = {&g0, &g1};
  Shardwire__RegisterOptimizer ro = SHARDWIRE__REGISTER_OPTIMIZER__INIT;
  ro.name = "opt";
  ro.kind = SHARDWIRE__OPTIM_KIND__ADAMW;
  ro.groups = gp;
  ro.n_groups = 2;
  shardd__optim_plan plan;
  char *msg = NULL;
  shardd__optspec spec;
  cr_assert_eq(shardd__optspec_from_wire(&ro, &spec), SHARDD_OK);
  cr_assert_eq(shardd__validate_optimizer(&reg, job, &spec, &plan, &msg), SHARDD_OK,
               "%s", msg ? msg : "");
  shardd__optspec_free(&spec);
  /* the recorded identity is the packed wire message, as checkpoints
   * written before optcodec.h hold it */
  plan.spec_len = shardwire__register_optimizer__get_packed_size(&ro);
  plan.spec = malloc(plan.spec_len);
  shardwire__register_optimizer__pack(&ro, plan.spec);
  shardd__optim *o;
  cr_assert_eq(shardd__optim_create(&reg, job, &plan, &o, err, sizeof err), SHARDD_OK);
  shardd__optim_plan_free(&plan);
  o->steps = 7;
  /* torch's per-parameter step counts: refs skipped by some steps (frozen,
   * or no gradient) took fewer */
  for (size_t k = 0; k < o->nrefs; k++)
    o->ref_steps[k] = 7 - 2 * (uint64_t)k;

  for (uint32_t k = 0; k < 3; k++) {
    fill_random((char *)a->blocks[k]->ptr + a->shard_off, a->shard_numel * 4);
    fill_random((char *)b->blocks[k]->ptr + b->shard_off, b->shard_numel * 2);
  }
  for (size_t i = 0; i < o->nshards; i++) {
    fill_random(o->shards[i].state->ptr, o->shards[i].state->bytes);
    o->shards[i].master_valid = (int)(i % 2);
  }
  return job;
}

void image_add(image *im, const void *p, size_t n) {
  im->bytes = realloc(im->bytes, im->len + n);
  memcpy(im->bytes + im->len, p, n);
  im->len += n;
}

image snapshot(shardd__job *job) {
  image im = {NULL, 0};
  shardd__buffer **bufs;
  size_t nb;
  cr_assert_eq(shardd__job_buffers(job, &bufs, &nb), SHARDD_OK);
  for (size_t i = 0; i < nb; i++) {
    shardd__buffer *b = bufs[i];
    image_add(&im, b->hdr.name, strlen(b->hdr.name) + 1);
    for (uint32_t r = 0; r < b->world; r++)
      image_add(&im, (char *)b->blocks[r]->ptr + b->shard_off,
                b->shard_numel * shardd_dtype_size(b->dtype));
    shardd__view **views;
    size_t nv;
    cr_assert_eq(shardd__buffer_views(b, &views, &nv), SHARDD_OK);
    for (size_t k = 0; k < nv; k++) {
      image_add(&im, views[k]->hdr.name, strlen(views[k]->hdr.name) + 1);
      image_add(&im, &views[k]->offset, sizeof views[k]->offset);
      image_add(&im, &views[k]->numel, sizeof views[k]->numel);
      image_add(&im, views[k]->shape, (size_t)views[k]->ndim * sizeof(int64_t));
      cr_assert_not_null(views[k]->owner);
    }
    free(views);
  }
  free(bufs);
  shardd__optim *o = shardd__optim_find(job, "opt");
  cr_assert_not_null(o);
  image_add(&im, &o->steps, sizeof o->steps);
  for (size_t k = 0; k < o->nrefs; k++) {
    image_add(&im, o->refs[k]->name, strlen(o->refs[k]->name) + 1);
    image_add(&im, &o->ref_steps[k], sizeof o->ref_steps[k]);
  }
  for (size_t i = 0; i < o->nshards; i++) {
    image_add(&im, &o->shards[i].master_valid, sizeof(int));
    image_add(&im, o->shards[i].state->ptr, o->shards[i].state->bytes);
  }
  return im;
}

/* The name of in's data file that starts "prefix-" (each checkpoint tags
 * its files: b0-r0-TAG.shard), in out; "manifest" stays as it is. */
void data_name(const char *in, const char *prefix, char *out, size_t n) {
  if (strchr(prefix, '.') || !strcmp(prefix, "manifest")) {
    snprintf(out, n, "%s", prefix);
    return;
  }
  DIR *d = opendir(in);
  cr_assert_not_null(d, "%s", in);
  size_t pl = strlen(prefix);
  out[0] = '\0';
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    if (!strncmp(e->d_name, prefix, pl) && e->d_name[pl] == '-')
      snprintf(out, n, "%.*s", (int)(n - 1), e->d_name);
  closedir(d);
  cr_assert(out[0], "no data file %s-* in %s", prefix, in);
}

/* Seals an edited manifest again as shardd does (its "end" line carries
 * the CRC32C of the bytes before it), so a test of what the parser refuses
 * reaches the parser. */
void reseal(const char *path) {
  char *text = test_slurp(path);
  cr_assert_not_null(text);
  char *end = strstr(text, "\nend ");
  if (end != NULL) {
    uint32_t crc = shardd__crc32c(0, text, (size_t)(end + 1 - text));
    char *rest = strchr(end + 1, '\n');
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "%.*send %08x\n%s", (int)(end + 1 - text), text, crc,
            rest ? rest + 1 : "");
    fclose(f);
  }
  free(text);
}

#define WORLD 2

#define MAXW 4

#define NUMEL 1003

#define HALF 301

void grad_for(int step, uint32_t rank, float *g, uint64_t n) {
  for (uint64_t i = 0; i < n; i++)
    g[i] = (float)((int)((i * 7 + (uint64_t)step * 13 + rank * 5) % 17) - 8) / 16.0f;
}

uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

void *run_rank(void *p) {
  rank_arg *a = p;
  shardd_client_t *c = test_connect(a->d, "ckpt-job", a->rank, a->world);
  /* every resume (a restore at start, shardctl restore, a relaunch onto
   * the lingering job) tells each rank the step it resumes at; a fresh
   * job is told nothing */
  uint64_t resumed_at;
  int resumed = shardd_resumed(c, &resumed_at);
  cr_assert_eq(resumed, a->first_step > 0, "rank %u: resumed %d at step %" PRIu64
               ", expected %s step %d", a->rank, resumed, resumed_at,
               a->first_step > 0 ? "a resume at" : "no resume before",
               a->first_step);
  if (resumed)
    cr_assert_eq(resumed_at, (uint64_t)a->first_step,
                 "rank %u told it resumes at step %" PRIu64 ", not %d", a->rank,
                 resumed_at, a->first_step);
  shardd_buffer_info b, h;
  cr_assert_eq(shardd_buffer_register(c, "flat", SHARDD_DTYPE_FP32, NUMEL, &b), SHARDD_OK,
               "%s", shardd_last_error(c));
  cr_assert_eq(shardd_buffer_register(c, "half", SHARDD_DTYPE_BF16, HALF, &h), SHARDD_OK,
               "%s", shardd_last_error(c));
  if (a->first_step == 0) { /* a fresh job: each rank fills its own shard */
    for (uint64_t i = 0; i < b.shard_numel; i++) {
      uint64_t g = a->rank * b.shard_numel + i;
      ((float *)b.shard)[i] = g < NUMEL ? (float)g / 100.0f : 0.0f;
    }
    for (uint64_t i = 0; i < h.shard_numel; i++) {
      uint64_t g = a->rank * h.shard_numel + i;
      ((uint16_t *)h.shard)[i] = to_bf16(g < HALF ? (float)g / 64.0f : 0.0f);
    }
  }
  uint64_t v1, v2, v3;
  int64_t s1[1] = {600}, s2[1] = {NUMEL - 600}, s3[1] = {HALF};
  cr_assert_eq(shardd_view_register(c, b.id, "w", 0, 600, s1, 1, &v1), SHARDD_OK);
  cr_assert_eq(shardd_view_register(c, b.id, "b", 600, NUMEL - 600, s2, 1, &v2), SHARDD_OK);
  cr_assert_eq(shardd_view_register(c, h.id, "e", 0, HALF, s3, 1, &v3), SHARDD_OK);
  shardd_param_ref refs[3] = {{v1, "w"}, {v2, "b"}, {v3, "e"}};
  shardd_param_group g[2] = {{refs, 2, {0}},
                             {refs + 2, 1, {.set = SHARDD_HP_AMSGRAD, .amsgrad = 1}}};
  shardd_hparams hp = {.set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY, .lr = 0.01,
                       .weight_decay = 0.1};
  uint64_t opt;
  cr_assert_eq(shardd_optimizer_register(c, "adamw", SHARDD_OPTIM_ADAMW, &hp, g, 2, &opt),
               SHARDD_OK, "%s", shardd_last_error(c));
  pthread_barrier_wait(a->bar);
  for (int s = 0; s < a->steps; s++) {
    cr_assert_eq(shardd_gather(c, b.id), SHARDD_OK, "%s", shardd_last_error(c));
    if (a->global_grad && a->rank != 0) {
      memset(b.grad, 0, b.padded_numel * 4);
      memset(h.grad, 0, h.padded_numel * 2);
    } else {
      grad_for(a->first_step + s, a->global_grad ? 0 : a->rank, b.grad, b.padded_numel);
      float tmp[HALF + MAXW];
      grad_for(a->first_step + s, a->global_grad ? 0 : a->rank + 1, tmp, h.padded_numel);
      for (uint64_t i = 0; i < h.padded_numel; i++)
        ((uint16_t *)h.grad)[i] = to_bf16(tmp[i]);
    }
    shardd_reduce_op op = a->global_grad ? SHARDD_REDUCE_SUM : SHARDD_REDUCE_MEAN;
    cr_assert_eq(shardd_scatter(c, b.id, op), SHARDD_OK);
    cr_assert_eq(shardd_scatter(c, h.id, op), SHARDD_OK);
    cr_assert_eq(shardd_step(c, opt, NULL, NULL), SHARDD_OK, "%s", shardd_last_error(c));
    if (a->progress && a->rank == 0)
      __atomic_store_n(a->progress, s + 1, __ATOMIC_RELEASE);
  }
  pthread_barrier_wait(a->bar);
  if (a->ckpt && a->rank == 0)
    cr_assert_eq(shardd_checkpoint(c, NULL, a->ckpt), SHARDD_OK, "%s", shardd_last_error(c));
  pthread_barrier_wait(a->bar);
  cr_assert_eq(shardd_gather(c, b.id), SHARDD_OK);
  cr_assert_eq(shardd_gather(c, h.id), SHARDD_OK);
  if (a->out) {
    memcpy(a->out, b.gather, NUMEL * sizeof(float));
    for (uint64_t i = 0; i < HALF; i++)
      a->out[NUMEL + i] = from_bf16(((uint16_t *)h.gather)[i]);
  }
  shardd_close(c);
  return NULL;
}

void run_world(const test_daemon *d, uint32_t world, int global_grad,
                      int steps, int first, const char *ckpt, float *out) {
  pthread_t t[MAXW];
  rank_arg a[MAXW];
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, world);
  for (uint32_t r = 0; r < world; r++) {
    a[r] = (rank_arg){d, r, world, steps, first, global_grad, ckpt,
                      r == 0 ? out : NULL, &bar, NULL};
    pthread_create(&t[r], NULL, run_rank, &a[r]);
  }
  for (uint32_t r = 0; r < world; r++)
    pthread_join(t[r], NULL);
  pthread_barrier_destroy(&bar);
}

void run_job(const test_daemon *d, int steps, int first, const char *ckpt,
                    float *out) {
  run_world(d, WORLD, 0, steps, first, ckpt, out);
}

/* The steps of the (one) optimizer of the daemon's only job. */
uint64_t job_steps(const test_daemon *d) {
  char cmd[256], *out = NULL, *errs = NULL;
  snprintf(cmd, sizeof cmd, "--socket %s --json status", d->sock);
  cr_assert_eq(test_shardctl(NULL, cmd, &out, &errs), 0, "%s", errs);
  tj *j = tj_parse(out);
  cr_assert_not_null(j, "%s", out);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, 1, "%s", out);
  const tj *opts = tj_need(jobs->kids[0], "optimizers", TJ_ARR);
  cr_assert_eq(opts->n, 1, "%s", out);
  uint64_t steps = (uint64_t)tj_need(opts->kids[0], "steps", TJ_NUM)->num;
  tj_free(j);
  free(out);
  free(errs);
  return steps;
}

void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f, "%s", path);
  fputs(text, f);
  fclose(f);
}

/* An SGD optimizer over buffer buf on raw client r; its id. */
uint64_t raw_sgd(test_raw *r, uint64_t buf) {
  Shardwire__ParamRef ref = SHARDWIRE__PARAM_REF__INIT, *rp = &ref;
  ref.id = buf;
  Shardwire__ParamGroup g = SHARDWIRE__PARAM_GROUP__INIT, *gp = &g;
  g.refs = &rp;
  g.n_refs = 1;
  Shardwire__HyperParams hp = SHARDWIRE__HYPER_PARAMS__INIT;
  hp.has_lr = 1;
  hp.lr = 0.5;
  Shardwire__RegisterOptimizer ro = SHARDWIRE__REGISTER_OPTIMIZER__INIT;
  ro.name = "sgd";
  ro.kind = SHARDWIRE__OPTIM_KIND__SGD;
  ro.hyper = &hp;
  ro.groups = &gp;
  ro.n_groups = 1;
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_OPTIMIZER;
  req.register_optimizer = &ro;
  Shardwire__Response *resp = test_raw_expect(r, test_raw_send(r, &req), SHARDD_OK);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_OPTIMIZER);
  uint64_t id = resp->optimizer->id;
  shardwire__response__free_unpacked(resp, NULL);
  return id;
}

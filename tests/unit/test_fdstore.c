/* test_fdstore.c — suite fdstore: the fd store's descriptions in process,
 * against a receiver that keeps what the daemon stores (as systemd's fd
 * store does): a job adopted from them maps the very memory that was
 * stored (same file, not a copy, its bytes as written) at the step its
 * description records; a step still in progress, named or only counted
 * past the journal's records, makes the job torn; a step's counts are
 * committed through the journal, the description rewritten only when the
 * job changed, and a description of the format before that still adopted;
 * a damaged journal refuses the job. The daemon-level
 * protocol (LISTEN_FDS, SIGKILL, trainers) is tests/python/
 * test_daemon_restart.py. */
#include <criterion/criterion.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <uv.h>

#include "backend.h"
#include "fdstore.h"
#include "optcodec.h"
#include "optreg.h"
#include "registry.h"
#include "ckfile.h"
#include "fdstore_int.h"

#define MAXFD 256

static char dir[64], path[96];
static int rx = -1;
/* what the receiver keeps: FDNAME -> fd */
static char *names[MAXFD];
static int fds[MAXFD];
static size_t nfds;

static void init(void) {
  strcpy(dir, "/tmp/shardd-fdstore-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/notify", dir);
  rx = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  cr_assert_eq(bind(rx, (struct sockaddr *)&sa, sizeof sa), 0, "%s",
               strerror(errno));
  int big = 4 << 20;
  setsockopt(rx, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
  setenv("NOTIFY_SOCKET", path, 1);
  nfds = 0;
}

static void fini(void) {
  for (size_t i = 0; i < nfds; i++) {
    close(fds[i]);
    free(names[i]);
  }
  close(rx);
  unlink(path);
  rmdir(dir);
}

/* Reads every datagram sent so far, keeping FDSTORE's fds by name and
 * dropping FDSTOREREMOVE's. */
static void pump(void) {
  for (;;) {
    char buf[512];
    union {
      char b[CMSG_SPACE(sizeof(int))];
      struct cmsghdr align;
    } ctl;
    struct iovec iov = {buf, sizeof buf - 1};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.b;
    mh.msg_controllen = sizeof ctl.b;
    ssize_t n = recvmsg(rx, &mh, MSG_CMSG_CLOEXEC);
    if (n < 0)
      return;
    buf[n] = '\0';
    int fd = -1;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
        memcpy(&fd, CMSG_DATA(cm), sizeof fd);
    char *name = strstr(buf, "FDNAME=");
    cr_assert_not_null(name, "a datagram without FDNAME: %s", buf);
    name += 7;
    if (strncmp(buf, "FDSTORE=1", 9) == 0) {
      cr_assert_geq(fd, 0, "FDSTORE=1 without its descriptor");
      cr_assert_lt(nfds, (size_t)MAXFD);
      names[nfds] = strdup(name);
      fds[nfds++] = fd;
    } else if (strncmp(buf, "FDSTOREREMOVE=1", 15) == 0) {
      for (size_t i = 0; i < nfds; i++)
        if (strcmp(names[i], name) == 0) {
          close(fds[i]);
          free(names[i]);
          fds[i] = fds[--nfds];
          names[i] = names[nfds];
          break;
        }
    }
  }
}

/* One daemon's worth: a host backend keeping every region in the store, a
 * registry, a loop and the fd store. */
typedef struct {
  shardd__backend *be;
  shardd__registry reg;
  uv_loop_t loop;
  shardd__fdstore *fs;
} daemon_t;

static void daemon_up(daemon_t *d) {
  char err[256];
  cr_assert_eq(shardd__backend_host_create(1, 64 << 20, &d->be, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__backend_host_persist(d->be, SHARDD__PERSIST_ON);
  shardd__registry_init(&d->reg, d->be);
  uv_loop_init(&d->loop);
  cr_assert_eq(shardd__fdstore_create(&d->loop, &d->reg, NULL, NULL, &d->fs),
               SHARDD_OK);
}

/* A crash leaves the store as it is: nothing is taken out. */
static void daemon_crash(daemon_t *d) {
  shardd__fdstore_stop(d->fs);
  shardd__backend_host_persist(d->be, SHARDD__PERSIST_DETACHED);
  uv_run(&d->loop, UV_RUN_DEFAULT); /* the handle's close */
  shardd__registry_free(&d->reg);
  shardd__fdstore_free(d->fs);
  uv_loop_close(&d->loop);
  d->be->ops->destroy(d->be);
}

static shardd__job *adopted_job;
static uint64_t adopted_step;

static void on_adopted(void *arg, shardd__job *job, uint64_t step) {
  adopted_job = job;
  adopted_step = step;
}

/* Hands every kept fd to d (dups: the receiver keeps its own). */
static int adopt_all(daemon_t *d) {
  shardd__fdstore_fd in[MAXFD];
  for (size_t i = 0; i < nfds; i++)
    in[i] = (shardd__fdstore_fd){fcntl(fds[i], F_DUPFD_CLOEXEC, 0), names[i]};
  adopted_job = NULL;
  return shardd__fdstore_adopt(d->fs, in, nfds, on_adopted, NULL);
}

/* An optimizer as the step hooks see it: only its address and name. */
static shardd__optim *fake_optim(const char *name) {
  shardd__optim *o = calloc(1, sizeof *o);
  o->hdr.name = strdup(name);
  return o;
}

static void free_fake(shardd__optim *o) {
  free(o->hdr.name);
  free(o);
}

static shardd__job *job_with_buffer(daemon_t *d, shardd__buffer **b) {
  char err[256];
  shardd__job *job;
  int created;
  cr_assert_eq(shardd__job_get(&d->reg, "j", 2, 0, &job, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(shardd__buffer_register(&d->reg, job, "w", SHARDD_DTYPE_FP32,
                                       1000, b, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  for (uint32_t r = 0; r < 2; r++) {
    float *p = (float *)((char *)(*b)->blocks[r]->ptr + (*b)->shard_off);
    for (uint64_t i = 0; i < (*b)->shard_numel; i++)
      p[i] = (float)(r * 10000 + i);
  }
  return job;
}

TestSuite(fdstore, .init = init, .fini = fini);

Test(fdstore, adopted_job_maps_the_stored_memory) {
  daemon_t a, b;
  shardd__buffer *buf;
  daemon_up(&a);
  shardd__job *job = job_with_buffer(&a, &buf);
  shardd__optim *o = fake_optim("adamw");
  /* a step begun and ended: its description written, its record cleared */
  shardd__fdstore_step_begin(a.fs, job, o, 1);
  shardd__fdstore_step_end(a.fs, job, o, 1, SHARDD_OK);
  struct stat before[2];
  for (int r = 0; r < 2; r++)
    cr_assert_eq(fstat(buf->blocks[r]->fd, &before[r]), 0);
  pump();
  daemon_crash(&a);
  free_fake(o);
  pump();
  cr_assert_geq(nfds, 5, "2 regions and 3 description memfds: %zu", nfds);

  daemon_up(&b);
  cr_assert_eq(adopt_all(&b), 0, "a job was refused");
  cr_assert_not_null(adopted_job);
  shardd__buffer *w = shardd__map_get_str(&adopted_job->buffers, "w");
  cr_assert_not_null(w);
  for (uint32_t r = 0; r < 2; r++) {
    struct stat st;
    cr_assert_eq(fstat(w->blocks[r]->fd, &st), 0);
    cr_assert(st.st_ino == before[r].st_ino && st.st_dev == before[r].st_dev,
              "rank %u: not the stored memory (a copy?)", r);
    const float *p = (const float *)((char *)w->blocks[r]->ptr + w->shard_off);
    for (uint64_t i = 0; i < w->shard_numel; i++)
      cr_assert_eq(p[i], (float)(r * 10000 + i), "rank %u element %lu", r,
                   (unsigned long)i);
  }
  cr_assert_not(shardd__fdstore_torn(b.fs, 0, "j", (char[8]){0}, 8));
  cr_assert(shardd__fdstore_held(b.fs, 0, "j"));
  pump();
  daemon_crash(&b);
}

Test(fdstore, a_step_in_progress_makes_the_job_torn) {
  daemon_t a, b;
  shardd__buffer *buf;
  daemon_up(&a);
  shardd__job *job = job_with_buffer(&a, &buf);
  shardd__optim *o = fake_optim("adamw");
  shardd__fdstore_step_begin(a.fs, job, o, 7);
  pump();
  daemon_crash(&a);
  free_fake(o);
  pump();

  daemon_up(&b);
  cr_assert_eq(adopt_all(&b), 1);
  cr_assert_null(adopted_job);
  char msg[1024];
  cr_assert(shardd__fdstore_torn(b.fs, 0, "j", msg, sizeof msg));
  cr_assert_not_null(strstr(msg, "step 7 of optimizer \"adamw\""), "%s", msg);
  cr_assert(shardd__fdstore_forget_torn(b.fs, 0, "j"));
  cr_assert_not(shardd__fdstore_torn(b.fs, 0, "j", msg, sizeof msg));
  pump();
  daemon_crash(&b);
}

/* 31 records; a 32nd step at once is only counted, and still tears the
 * job when it is the one left running. */
Test(fdstore, a_step_past_the_records_is_counted_and_tears_too) {
  daemon_t a, b;
  shardd__buffer *buf;
  shardd__optim *o[32];
  daemon_up(&a);
  shardd__job *job = job_with_buffer(&a, &buf);
  for (int i = 0; i < 32; i++) {
    char name[16];
    snprintf(name, sizeof name, "o%d", i);
    o[i] = fake_optim(name);
    shardd__fdstore_step_begin(a.fs, job, o[i], 1);
  }
  for (int i = 0; i < 31; i++)
    shardd__fdstore_step_end(a.fs, job, o[i], 1, SHARDD_OK);
  pump();
  daemon_crash(&a);
  for (int i = 0; i < 32; i++)
    free_fake(o[i]);
  pump();

  daemon_up(&b);
  cr_assert_eq(adopt_all(&b), 1);
  char msg[1024];
  cr_assert(shardd__fdstore_torn(b.fs, 0, "j", msg, sizeof msg));
  cr_assert_not_null(strstr(msg, "during one of its steps"), "%s", msg);
  pump();
  daemon_crash(&b);
}

/* ---- step counts committed through the journal ------------------------- */

/* An AdamW optimizer over job's buffer b, registered as the daemon does
 * (its registration kept for the manifest). */
static shardd__optim *real_optim(daemon_t *d, shardd__job *job,
                                 shardd__buffer *b) {
  Shardwire__RegisterOptimizer req = SHARDWIRE__REGISTER_OPTIMIZER__INIT;
  Shardwire__HyperParams hp = SHARDWIRE__HYPER_PARAMS__INIT;
  Shardwire__ParamGroup g = SHARDWIRE__PARAM_GROUP__INIT;
  Shardwire__ParamRef r = SHARDWIRE__PARAM_REF__INIT;
  Shardwire__ParamRef *rp = &r;
  Shardwire__ParamGroup *gp = &g;
  r.id = b->hdr.id;
  g.refs = &rp;
  g.n_refs = 1;
  req.name = "adamw";
  req.kind = (Shardwire__OptimKind)SHARDD_OPTIM_ADAMW;
  req.hyper = &hp;
  req.groups = &gp;
  req.n_groups = 1;
  shardd__optspec spec;
  shardd__optreg_result res;
  char err[256];
  cr_assert_eq(shardd__optspec_from_wire(&req, &spec), SHARDD_OK);
  shardd_err rc = shardd__optreg_register(&d->reg, job, &spec, 0, &res, err,
                                          sizeof err);
  shardd__optspec_free(&spec);
  cr_assert_eq(rc, SHARDD_OK, "%s %s", err, res.list ? res.list : "");
  free(res.list);
  shardd__optim *o = res.optim;
  return o;
}

/* One optimizer step as the engine's hooks see it: the record set, the
 * counts (and, at the first, the master copy) changed, the record
 * cleared. */
static void step(daemon_t *d, shardd__job *job, shardd__optim *o) {
  uint64_t s = o->steps + 1;
  shardd__fdstore_step_begin(d->fs, job, o, s);
  for (size_t k = 0; k < o->nshards; k++)
    o->shards[k].master_valid = 1;
  o->steps = s;
  for (size_t k = 0; k < o->nrefs; k++)
    o->ref_steps[k] = s;
  shardd__fdstore_step_end(d->fs, job, o, s, SHARDD_OK);
}

/* The kept fd named BASE-suffix of the one description ("-a", "-b", "-j"). */
static int kept(const char *suffix) {
  int fd = -1;
  for (size_t i = 0; i < nfds; i++) {
    size_t l = strlen(names[i]);
    if (!strncmp(names[i], "shardd-m", 8) && l > 2 &&
        !strcmp(names[i] + l - 2, suffix)) {
      cr_assert_eq(fd, -1, "one description only");
      fd = fds[i];
    }
  }
  cr_assert_geq(fd, 0, "no description memfd %s", suffix);
  return fd;
}

/* The newest slot's generation; *k its slot (0 a, 1 b). */
static uint64_t newest_gen(int *k) {
  uint64_t best = 0;
  for (int i = 0; i < 2; i++) {
    struct {
      char magic[8];
      uint64_t gen;
    } h = {{0}, 0};
    if (pread(kept(i ? "-b" : "-a"), &h, sizeof h, 0) == (ssize_t)sizeof h &&
        h.gen > best) {
      best = h.gen;
      if (k)
        *k = i;
    }
  }
  return best;
}

/* A job of one buffer and an AdamW optimizer that took its first step. */
static shardd__job *stepped_job(daemon_t *d, shardd__optim **o) {
  shardd__buffer *buf;
  shardd__job *job = job_with_buffer(d, &buf);
  shardd__fdstore_touch(d->fs, job);
  *o = real_optim(d, job, buf);
  shardd__fdstore_touch(d->fs, job);
  step(d, job, *o);
  return job;
}

static void expect_adopted_at(daemon_t *d, uint64_t steps) {
  cr_assert_eq(adopt_all(d), 0, "the job was refused");
  cr_assert_not_null(adopted_job);
  cr_expect_eq(adopted_step, steps);
  shardd__optim *o = shardd__optim_find(adopted_job, "adamw");
  cr_assert_not_null(o);
  cr_expect_eq(o->steps, steps);
  cr_assert_eq(o->nrefs, 1);
  cr_expect_eq(o->ref_steps[0], steps, "its ref's step count");
  for (size_t k = 0; k < o->nshards; k++)
    cr_expect(o->shards[k].master_valid || o->shards[k].state == NULL);
}

Test(fdstore, steps_are_committed_through_the_journal_not_the_description) {
  daemon_t a, b;
  shardd__optim *o;
  daemon_up(&a);
  shardd__job *job = stepped_job(&a, &o);
  pump();
  uint64_t gen = newest_gen(NULL);
  cr_assert_gt(gen, 0);
  for (int i = 0; i < 4; i++)
    step(&a, job, o);
  pump();
  cr_expect_eq(newest_gen(NULL), gen, "a step without a change to the job "
               "rewrote its description");
  daemon_crash(&a);
  pump();

  daemon_up(&b);
  expect_adopted_at(&b, 5);
  pump();
  daemon_crash(&b);
}

Test(fdstore, a_change_of_the_job_is_described_at_the_next_step) {
  daemon_t a, b;
  shardd__optim *o;
  daemon_up(&a);
  shardd__job *job = stepped_job(&a, &o);
  step(&a, job, o);
  pump();
  uint64_t gen = newest_gen(NULL);
  /* a view registered (dispatch touches the job), then a step; a view,
   * not a buffer: no regions more, whose datagrams the receiver would
   * have to read while the adoption sends them */
  char err[256];
  shardd__buffer *w = shardd__map_get_str(&job->buffers, "w");
  shardd__view *v;
  int created;
  int64_t shape[1] = {10};
  cr_assert_eq(shardd__view_register(&a.reg, job, w->hdr.id, "head", 0, 10,
                                     shape, 1, &v, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__fdstore_touch(a.fs, job);
  step(&a, job, o);
  pump();
  cr_expect_gt(newest_gen(NULL), gen, "the change was not described");
  step(&a, job, o);
  daemon_crash(&a);
  pump();

  daemon_up(&b);
  expect_adopted_at(&b, 4);
  shardd__view **vs;
  size_t nv;
  cr_assert_eq(shardd__buffer_views(shardd__map_get_str(&adopted_job->buffers,
                                                        "w"), &vs, &nv),
               SHARDD_OK);
  cr_expect(nv == 1 && !strcmp(vs[0]->hdr.name, "head"), "the view is lost");
  free(vs);
  pump();
  daemon_crash(&b);
}

Test(fdstore, a_kill_inside_a_step_after_journal_steps_tears_the_job) {
  daemon_t a, b;
  shardd__optim *o;
  daemon_up(&a);
  shardd__job *job = stepped_job(&a, &o);
  step(&a, job, o);
  step(&a, job, o);
  shardd__fdstore_step_begin(a.fs, job, o, 4);
  o->steps = 4; /* killed with its counts changed, its record still set */
  o->ref_steps[0] = 4;
  pump();
  daemon_crash(&a);
  pump();

  daemon_up(&b);
  cr_assert_eq(adopt_all(&b), 1);
  cr_assert_null(adopted_job);
  char msg[1024];
  cr_assert(shardd__fdstore_torn(b.fs, 0, "j", msg, sizeof msg));
  cr_assert_not_null(strstr(msg, "step 4 of optimizer \"adamw\""), "%s", msg);
  pump();
  daemon_crash(&b);
}

/* What a daemon before the journal's step counts left: slots of format
 * "SHDMETA1" (every step rewrote them) and a journal of one page. */
Test(fdstore, a_description_of_the_format_before_is_adopted) {
  daemon_t a, b;
  shardd__optim *o;
  daemon_up(&a);
  shardd__job *job = stepped_job(&a, &o);
  step(&a, job, o);
  step(&a, job, o);
  shardd__fdstore_touch(a.fs, job); /* rewritten whole at the stop */
  daemon_crash(&a);
  pump();
  int k = -1;
  newest_gen(&k);
  int slot = kept(k ? "-b" : "-a"), jr = kept("-j");
  cr_assert_eq(pwrite(slot, "SHDMETA1", 8, 0), 8);
  cr_assert_eq(ftruncate(jr, 4096), 0);

  daemon_up(&b);
  expect_adopted_at(&b, 3);
  pump();
  /* and described anew in the current format */
  struct stat st;
  cr_assert_eq(fstat(kept("-j"), &st), 0);
  cr_expect_gt(st.st_size, 4096, "the journal holds no step counts");
  for (int i = 0; i < 2; i++) { /* no stale counts for an older daemon */
    char magic[9] = "";
    cr_assert_eq(pread(kept(i ? "-b" : "-a"), magic, 8, 0), 8);
    cr_expect_str_neq(magic, "SHDMETA1", "slot %d left in the format before", i);
  }
  shardd__optim *bo = shardd__optim_find(adopted_job, "adamw");
  step(&b, adopted_job, bo);
  daemon_crash(&b);
  pump();

  daemon_t c;
  daemon_up(&c);
  expect_adopted_at(&c, 4);
  pump();
  daemon_crash(&c);
}

/* The journal's step counts past its page: its header (magic, generation,
 * optimizers, bytes), then per optimizer its count, its refs', each ref's. */
static void expect_refused_for(const char *what) {
  daemon_t b;
  daemon_up(&b);
  cr_assert_eq(adopt_all(&b), 1, "a damaged journal was adopted");
  cr_assert_null(adopted_job);
  char msg[1024];
  cr_assert(shardd__fdstore_torn(b.fs, 0, "j", msg, sizeof msg));
  cr_expect_not_null(strstr(msg, what), "%s", msg);
  pump();
  daemon_crash(&b);
}

static void damaged_journal(off_t at, uint64_t value, const char *what) {
  daemon_t a;
  shardd__optim *o;
  daemon_up(&a);
  shardd__job *job = stepped_job(&a, &o);
  step(&a, job, o);
  daemon_crash(&a);
  pump();
  cr_assert_eq(pwrite(kept("-j"), &value, sizeof value, at),
               (ssize_t)sizeof value);
  expect_refused_for(what);
}

Test(fdstore, step_counts_of_a_later_generation_refuse_the_job) {
  damaged_journal(4096 + 8, 1000, "step journal is damaged");
}

Test(fdstore, step_counts_not_fitting_the_description_refuse_the_job) {
  /* the optimizer's refs counted 2, the manifest holds 1 */
  damaged_journal(4096 + 32 + 8, 2, "does not fit its description");
}

Test(fdstore, a_damaged_journal_page_refuses_the_job) {
  damaged_journal(0, 0, "step journal is damaged");
}

Test(fdstore, step_counts_counting_past_the_journal_refuse_the_job) {
  /* refs counted past the journal's end (their offset would wrap) */
  damaged_journal(4096 + 32 + 8, UINT64_MAX - 1, "does not fit its description");
}

/* ---- slabs: a batch's blocks of a rank in one memfd -------------------- */

/* Job "j" of 2 ranks whose buffers "p" and "q" were made by one batch: each
 * rank's two blocks in one slab, the description naming their offsets. */
static void slab_job(daemon_t *d) {
  char err[256];
  shardd__job *job;
  shardd__buffer *b;
  int created;
  cr_assert_eq(shardd__job_get(&d->reg, "j", 2, 0, &job, err, sizeof err),
               SHARDD_OK, "%s", err);
  uint64_t bb = shardd__buffer_block_bytes(job, SHARDD_DTYPE_FP32, 1000);
  cr_assert_eq(shardd__buffer_slabs_begin(&d->reg, job, 2 * bb, 2, err,
                                          sizeof err), SHARDD_OK, "%s", err);
  const char *names2[2] = {"p", "q"};
  for (int i = 0; i < 2; i++)
    cr_assert_eq(shardd__buffer_register(&d->reg, job, names2[i],
                                         SHARDD_DTYPE_FP32, 1000, &b, &created,
                                         err, sizeof err), SHARDD_OK, "%s", err);
  cr_assert_eq(shardd__buffer_slabs_end(&d->reg, err, sizeof err), SHARDD_OK,
               "%s", err);
  cr_assert_not_null(b->blocks[0]->slab);
  shardd__fdstore_touch(d->fs, job);
}

/* The newest description's line starting with line_start gets its last
 * word replaced by word, and the slot its length and CRC anew: a
 * description whole but wrong, as a bug (or a hand) could leave it. */
static void rewrite_last_word(const char *line_start, const char *word) {
  int k = -1;
  newest_gen(&k);
  int slot = kept(k ? "-b" : "-a");
  slot_hdr h;
  cr_assert_eq(pread(slot, &h, sizeof h, 0), (ssize_t)sizeof h);
  char *text = calloc(1, h.len + 64), *out = calloc(1, h.len + 128);
  cr_assert_eq(pread(slot, text, h.len, SLOT_TEXT_OFF), (ssize_t)h.len);
  char *at = strstr(text, line_start), *eol = at ? strchr(at, '\n') : NULL;
  cr_assert_not_null(eol, "no line \"%s\" in:\n%s", line_start, text);
  char *last = eol;
  while (last[-1] != ' ')
    last--;
  int n = snprintf(out, h.len + 128, "%.*s%s%s", (int)(last - text), text,
                   word, eol);
  h.len = (uint64_t)n;
  h.crc = shardd__crc32c(0, out, h.len);
  cr_assert_eq(pwrite(slot, out, h.len, SLOT_TEXT_OFF), (ssize_t)h.len);
  cr_assert_eq(pwrite(slot, &h, sizeof h, 0), (ssize_t)sizeof h);
  free(text);
  free(out);
}

Test(fdstore, a_job_in_slabs_is_adopted_with_its_blocks_at_their_offsets) {
  daemon_t a, b;
  daemon_up(&a);
  slab_job(&a);
  daemon_crash(&a);
  pump();
  daemon_up(&b);
  cr_assert_eq(adopt_all(&b), 0, "the job was refused");
  cr_assert_not_null(adopted_job);
  shardd__buffer *p = shardd__map_get_str(&adopted_job->buffers, "p"),
                 *q = shardd__map_get_str(&adopted_job->buffers, "q");
  for (uint32_t r = 0; r < 2; r++) {
    cr_assert_not_null(q->blocks[r]->slab);
    cr_expect_eq(q->blocks[r]->fd, p->blocks[r]->fd, "one file for a rank");
    cr_expect_eq(q->blocks[r]->off, p->blocks[r]->bytes);
  }
  pump();
  daemon_crash(&b);
}

Test(fdstore, a_slab_block_s_offset_past_its_file_refuses_the_job) {
  daemon_t a, b;
  daemon_up(&a);
  slab_job(&a);
  daemon_crash(&a);
  pump();
  /* its pointer would lie past the daemon's mapping of the file */
  rewrite_last_word("region buffer q 1 ", "1099511627776");
  daemon_up(&b);
  cr_assert_eq(adopt_all(&b), 1, "an offset past the file was adopted");
  cr_assert_null(adopted_job);
  pump();
  daemon_crash(&b);
}

Test(fdstore, a_region_line_of_more_words_than_any_refuses_the_job) {
  daemon_t a, b;
  daemon_up(&a);
  slab_job(&a);
  daemon_crash(&a);
  pump();
  /* its words were split into an array of 8 on the stack */
  rewrite_last_word("region buffer q 1 ", "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15");
  daemon_up(&b);
  cr_assert_eq(adopt_all(&b), 1, "a malformed region line was adopted");
  cr_assert_null(adopted_job);
  pump();
  daemon_crash(&b);
}

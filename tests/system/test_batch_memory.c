/* test_batch_memory.c — the memory behind buffers registered in batches,
 * against a real shardd: a batch's blocks of one rank come in one sealed
 * file (a slab) holding them and nothing else, each block at its own
 * offset; one buffer freed leaves the others readable and writable; a
 * client that maps blocks only at offset 0 of a descriptor of its own is
 * refused a block in a slab instead of mapping another buffer's bytes; a
 * client killed in the middle of a long batch leaves no memory and no
 * descriptor behind once its job is released. Expected sizes and offsets
 * come from the replies' own block sizes and the page size. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

static test_daemon d;

static void start(void) {
  const char *args[] = {"--devices", "1", NULL};
  test_daemon_start(&d, args);
}

static void stop(void) { test_daemon_finish(&d); }

TestSuite(batch_memory, .init = start, .fini = stop);

static shardd_buffer_spec bspec(const char *name, shardd_dtype dt,
                                uint64_t numel) {
  shardd_buffer_spec s = SHARDD_BUFFER_SPEC_INIT;
  s.name = name;
  s.dtype = dt;
  s.numel = numel;
  return s;
}

static float pattern(int i, uint64_t k, int round) {
  return (float)((round + 1) * 100000 + i * 1000 + (int)(k % 997));
}

Test(batch_memory, one_buffer_freed_leaves_the_others_readable_and_writable) {
  shardd_client_t *c = test_connect(&d, "freed-one", 0, 1);
  enum { N = 6, GONE = 2 };
  char nm[N][16];
  shardd_buffer_spec s[N];
  shardd_buffer_info bi[N];
  for (int i = 0; i < N; i++) {
    snprintf(nm[i], sizeof nm[i], "p%d", i);
    s[i] = bspec(nm[i], SHARDD_DTYPE_FP32, 1000 + 1500 * (uint64_t)i);
  }
  cr_assert_eq(shardd_buffers_register(c, N, s, bi, NULL), SHARDD_OK, "%s",
               shardd_last_error(c));
  for (int i = 0; i < N; i++)
    for (uint64_t k = 0; k < bi[i].numel; k++)
      ((float *)bi[i].shard)[k] = pattern(i, k, 0);
  cr_assert_eq(shardd_buffer_unregister(c, bi[GONE].id), SHARDD_OK, "%s",
               shardd_last_error(c));
  for (int round = 0; round < 2; round++)
    for (int i = 0; i < N; i++) {
      if (i == GONE)
        continue;
      /* what this client wrote is still there, and the daemon sees it
       * (a gather of world 1 copies the shard) */
      cr_assert_eq(shardd_gather(c, bi[i].id), SHARDD_OK, "%s",
                   shardd_last_error(c));
      const float *sh = bi[i].shard, *g = bi[i].gather;
      for (uint64_t k = 0; k < bi[i].numel; k++) {
        cr_assert_eq(sh[k], pattern(i, k, round), "buffer %d elem %" PRIu64, i, k);
        cr_assert_eq(g[k], pattern(i, k, round), "buffer %d elem %" PRIu64, i, k);
      }
      for (uint64_t k = 0; k < bi[i].numel; k++) /* and writable */
        ((float *)bi[i].shard)[k] = pattern(i, k, round + 1);
    }
  /* the name freed registers anew: fresh zeros, not the old bytes */
  shardd_buffer_info again;
  cr_assert_eq(shardd_buffer_register(c, nm[GONE], SHARDD_DTYPE_FP32,
                                      s[GONE].numel, &again), SHARDD_OK);
  cr_assert_eq(again.created, 1);
  cr_assert_eq(again.generation, 2);
  for (uint64_t k = 0; k < again.numel; k++)
    cr_assert_eq(((float *)again.shard)[k], 0.0f);
  shardd_close(c);
}

/* A raw client whose Hello says it maps blocks at offsets (as libshardd). */
static void hello_at_offsets(test_raw *r, const char *job, uint32_t rank,
                             uint32_t world) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Hello h = SHARDWIRE__HELLO__INIT;
  h.protocol_version = SHARDD_PROTOCOL_VERSION;
  h.job = (char *)job;
  h.has_rank = h.has_world = 1;
  h.rank = rank;
  h.world = world;
  h.has_blocks_at_offsets = h.blocks_at_offsets = 1;
  req.body_case = SHARDWIRE__REQUEST__BODY_HELLO;
  req.hello = &h;
  uint64_t seq = test_raw_send(r, &req);
  shardwire__response__free_unpacked(test_raw_expect(r, seq, SHARDD_OK), NULL);
}

/* A BuffersBatch registering n fp32 buffers named PREFIX0.. of numel[i]. */
static uint64_t send_batch(test_raw *r, const char *prefix, size_t n,
                           const uint64_t *numel) {
  Shardwire__RegisterBuffer rb[8], *rbp[8];
  char nm[8][32];
  cr_assert_leq(n, 8);
  for (size_t i = 0; i < n; i++) {
    shardwire__register_buffer__init(&rb[i]);
    snprintf(nm[i], sizeof nm[i], "%s%zu", prefix, i);
    rb[i].name = nm[i];
    rb[i].dtype = SHARDWIRE__DTYPE__FP32;
    rb[i].numel = numel[i];
    rbp[i] = &rb[i];
  }
  Shardwire__RegisterBuffers rq = SHARDWIRE__REGISTER_BUFFERS__INIT;
  rq.n_buffers = n;
  rq.buffers = rbp;
  Shardwire__BuffersBatch bb = SHARDWIRE__BUFFERS_BATCH__INIT;
  bb.op_case = SHARDWIRE__BUFFERS_BATCH__OP_REGISTER;
  bb.register_ = &rq;
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_BUFFERS_BATCH;
  req.buffers_batch = &bb;
  return test_raw_send(r, &req);
}

Test(batch_memory, a_batch_s_blocks_come_in_one_sealed_file_holding_only_them) {
  test_raw r, other;
  test_raw_open(&d, &r);
  hello_at_offsets(&r, "sealed", 0, 1);
  const uint64_t numel[3] = {1000, 70000, 1};
  uint64_t seq = send_batch(&r, "s", 3, numel);
  int fd;
  Shardwire__Response *resp = test_raw_recv_fd(&r, &fd);
  cr_assert_eq(resp->seq, seq);
  cr_assert_eq(resp->code, SHARDWIRE__STATUS_CODE__OK, "%s", resp->message);
  cr_assert_geq(fd, 0, "one descriptor for the batch");
  size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  uint64_t end = 0;
  for (size_t i = 0; i < 3; i++) {
    const Shardwire__BufferReply *br = resp->buffers_batch->buffers[i];
    cr_assert(br->has_fd_index && br->fd_index == 0, "entry %zu", i);
    cr_assert(br->has_block_offset, "entry %zu", i);
    cr_assert_eq(br->block_offset % pg, 0, "entry %zu on a page", i);
    cr_assert_eq(br->block_offset, end, "entry %zu right after the one before", i);
    end = br->block_offset + br->block_bytes;
  }
  /* the file holds these blocks and nothing beyond them, and no holder of
   * its descriptor can make it larger (or smaller under the daemon) */
  struct stat st;
  cr_assert_eq(fstat(fd, &st), 0);
  cr_assert_eq((uint64_t)st.st_size, end);
  int seals = fcntl(fd, F_GET_SEALS);
  cr_assert_eq(seals & (F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL),
               F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL);
  cr_assert_neq(ftruncate(fd, st.st_size + (off_t)pg), 0);
  cr_assert_eq(errno, EPERM);
  cr_assert_neq(fallocate(fd, 0, st.st_size, (off_t)pg), 0, "grown by fallocate");
  /* each block mapped at its offset is the daemon's view of that buffer:
   * a write through it is what the daemon reads back (inspect's shard
   * bytes are not read here; a gather copies the shard into the block's
   * gather area) */
  const Shardwire__BufferReply *b1 = resp->buffers_batch->buffers[1];
  float *blk = mmap(NULL, b1->block_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                    fd, (off_t)b1->block_offset);
  cr_assert_neq(blk, MAP_FAILED);
  float *sh = (float *)((char *)blk + b1->shard_offset);
  for (uint64_t k = 0; k < b1->shard_numel; k++)
    sh[k] = (float)k;
  uint64_t gseq = test_raw_send_gather(&r, b1->id);
  shardwire__response__free_unpacked(test_raw_expect(&r, gseq, SHARDD_OK), NULL);
  const float *g = (const float *)((char *)blk + b1->gather_offset);
  for (uint64_t k = 0; k < b1->numel; k++)
    cr_assert_eq(g[k], (float)k, "elem %" PRIu64, k);
  munmap(blk, b1->block_bytes);
  /* another client's batch is another file: nothing of it is reachable
   * through this one */
  test_raw_open(&d, &other);
  hello_at_offsets(&other, "sealed-other", 0, 1);
  seq = send_batch(&other, "o", 2, numel);
  int ofd;
  Shardwire__Response *oresp = test_raw_recv_fd(&other, &ofd);
  cr_assert_eq(oresp->code, SHARDWIRE__STATUS_CODE__OK, "%s", oresp->message);
  struct stat ost;
  cr_assert_eq(fstat(ofd, &ost), 0);
  cr_assert(ost.st_ino != st.st_ino || ost.st_dev != st.st_dev);
  shardwire__response__free_unpacked(oresp, NULL);
  shardwire__response__free_unpacked(resp, NULL);
  close(ofd);
  close(fd);
  test_raw_close(&other);
  test_raw_close(&r);
}

Test(batch_memory, a_client_mapping_only_at_offset_zero_is_refused_a_block_in_a_slab) {
  /* rank 0 registers a batch: rank 1's blocks are made too, in rank 1's
   * slab; rank 1 then attaches without saying it maps at offsets */
  test_raw r0, r1;
  test_raw_open(&d, &r0);
  hello_at_offsets(&r0, "mixed", 0, 2);
  const uint64_t numel[2] = {4096, 4096};
  uint64_t seq = send_batch(&r0, "m", 2, numel);
  int fd;
  Shardwire__Response *resp = test_raw_recv_fd(&r0, &fd);
  cr_assert_eq(resp->seq, seq);
  cr_assert_eq(resp->code, SHARDWIRE__STATUS_CODE__OK, "%s", resp->message);
  shardwire__response__free_unpacked(resp, NULL);
  close(fd);
  test_raw_open(&d, &r1);
  test_raw_hello(&r1, "mixed", 1, 2);
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterBuffer rb = SHARDWIRE__REGISTER_BUFFER__INIT;
  rb.name = "m1";
  rb.dtype = SHARDWIRE__DTYPE__FP32;
  rb.numel = 4096;
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_BUFFER;
  req.register_buffer = &rb;
  seq = test_raw_send(&r1, &req);
  resp = test_raw_recv_fd(&r1, &fd);
  cr_assert_eq(resp->seq, seq);
  cr_assert_eq((shardd_err)resp->code, SHARDD_E_STATE, "%s: %s",
               shardd_err_name((shardd_err)resp->code), resp->message);
  cr_assert(strstr(resp->message, "blocks_at_offsets"), "%s", resp->message);
  cr_assert_lt(fd, 0, "no descriptor with the refusal");
  shardwire__response__free_unpacked(resp, NULL);
  /* the same in a batch: refused whole */
  seq = send_batch(&r1, "m", 2, numel);
  resp = test_raw_recv_fd(&r1, &fd);
  cr_assert_eq((shardd_err)resp->code, SHARDD_E_STATE, "%s", resp->message);
  cr_assert_lt(fd, 0);
  shardwire__response__free_unpacked(resp, NULL);
  test_raw_close(&r1);
  test_raw_close(&r0);
  /* libshardd says it maps at offsets: rank 1 attaches */
  shardd_client_t *c1 = test_connect(&d, "mixed", 1, 2);
  shardd_buffer_info bi;
  cr_assert_eq(shardd_buffer_register(c1, "m1", SHARDD_DTYPE_FP32, 4096, &bi),
               SHARDD_OK, "%s", shardd_last_error(c1));
  cr_assert_eq(bi.created, 0);
  cr_assert_eq(bi.rank, 1);
  ((float *)bi.shard)[bi.shard_numel - 1] = 1.0f; /* mapped whole */
  shardd_close(c1);
}

/* The daemon's open descriptors. */
static int daemon_fds(void) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)d.pid);
  DIR *dir = opendir(path);
  cr_assert_not_null(dir, "%s: %s", path, strerror(errno));
  int n = 0;
  for (struct dirent *e; (e = readdir(dir)) != NULL;)
    n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

/* The devices' used bytes, as shardctl status --json says. */
static double used_bytes(void) {
  char args[256], *out, *err;
  snprintf(args, sizeof args, "--socket %s status --json", d.sock);
  int rc = test_shardctl(NULL, args, &out, &err);
  cr_assert_eq(rc, 0, "shardctl status exited %d: %s", rc, err);
  tj *j = tj_parse(out);
  cr_assert_not_null(j, "%s", out);
  const tj *devs = tj_need(j, "devices", TJ_ARR);
  double used = 0;
  for (size_t i = 0; i < devs->n; i++)
    used += tj_need(devs->kids[i], "used_bytes", TJ_NUM)->num;
  tj_free(j);
  free(out);
  free(err);
  return used;
}

/* Registers batches of 1000 buffers under new names until killed. */
static void register_forever(void) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "killed";
  o.rank = 0;
  o.world = 1;
  shardd_client_t *c;
  char err[512];
  if (shardd_connect(d.sock, &o, &c, err, sizeof err) != SHARDD_OK)
    _exit(2);
  enum { N = 1000 };
  static char nm[N][32];
  static shardd_buffer_spec s[N];
  static shardd_buffer_info bi[N];
  for (int round = 0;; round++) {
    for (int i = 0; i < N; i++) {
      snprintf(nm[i], sizeof nm[i], "k%d.%d", round, i);
      s[i] = bspec(nm[i], SHARDD_DTYPE_FP32, 640);
    }
    if (shardd_buffers_register(c, N, s, bi, NULL) != SHARDD_OK)
      _exit(3);
  }
}

Test(batch_memory, a_client_killed_mid_batch_leaves_no_memory_or_descriptor) {
  int fds0 = daemon_fds();
  double used0 = used_bytes();
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0)
    register_forever();
  /* killed once it has registered some, most likely inside a call */
  double t0 = test_mono_s();
  while (used_bytes() < used0 + (4 << 20) && test_mono_s() - t0 < 30)
    test_sleep_ms(20);
  test_sleep_ms(7);
  kill(pid, SIGKILL);
  int status;
  cr_assert(test_wait_exit(pid, &status));
  cr_assert(WIFSIGNALED(status), "the registering child ended by itself (%d)",
            status);
  cr_assert_gt(used_bytes(), used0, "it registered some before it died");
  /* its job lingers for a relaunch; released, nothing of it is left */
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 0);
  shardd_err rc;
  t0 = test_mono_s();
  while ((rc = shardd_release_job(ctl, "killed", NULL, NULL)) == SHARDD_E_BUSY &&
         test_mono_s() - t0 < 10)
    test_sleep_ms(20); /* until the daemon reads the dead connection's end */
  cr_assert_eq(rc, SHARDD_OK, "%s", shardd_last_error(ctl));
  shardd_close(ctl);
  cr_assert_eq(used_bytes(), used0);
  t0 = test_mono_s();
  while (daemon_fds() != fds0 && test_mono_s() - t0 < 5)
    test_sleep_ms(20);
  cr_assert_eq(daemon_fds(), fds0, "every slab's descriptor closed");
}

/* fuzz_fdstore.c — libFuzzer target for the fd store's description text
 * and the adoption it drives at a restart (fdstore_adopt.c): its region
 * lines ("region buffer NAME RANK FDNAME [OFFSET]", "region state ..."),
 * a slab's blocks at their offsets (backend wrap_slab), and the manifest
 * after them. Once, a daemon in process stores a job of 2 ranks (buffers
 * "p" and "q" made by one batch, each rank's blocks in one memfd, a slab;
 * "w" alone in its own) in a receiver that keeps what it is sent, as
 * systemd's fd store does, and dies; each input then is the text of that
 * description (its CRC made anew, so the parser sees it: a description
 * whole but wrong, as a bug could leave it), adopted by a fresh daemon
 * from copies of the stored descriptors, which dies in turn. The slots'
 * and journal's bytes are put back before each input. Seeds in
 * tests/fuzz/corpus_fdstore/ (the description as written, and variants). */
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <uv.h>

#include "backend.h"
#include "ckfile.h"
#include "fdstore.h"
#include "fdstore_int.h"
#include "registry.h"
#include "fuzz_util.h"

#define MAXFD 64

static int rx = -1;
static char *names[MAXFD];
static int fds[MAXFD];
static size_t nfds;
/* the description's and journal's memfds as the first daemon left them */
static char *saved[MAXFD];
static size_t saved_len[MAXFD];
static int slot = -1; /* the newest slot's index in fds */

typedef struct {
  shardd__backend *be;
  shardd__registry reg;
  uv_loop_t loop;
  shardd__fdstore *fs;
} daemon_t;

/* Reads every datagram sent so far: keep, FDSTORE's kept by name (the
 * first daemon's); else every descriptor closed. */
static void pump(int keep) {
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
    ssize_t n = recvmsg(rx, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0)
      return;
    buf[n] = '\0';
    int fd = -1;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
        memcpy(&fd, CMSG_DATA(cm), sizeof fd);
    char *name = strstr(buf, "FDNAME=");
    if (keep && fd >= 0 && name && !strncmp(buf, "FDSTORE=1", 9) &&
        nfds < MAXFD) {
      names[nfds] = strdup(name + 7);
      fds[nfds++] = fd;
    } else if (fd >= 0) {
      close(fd);
    }
  }
}

static void daemon_up(daemon_t *d) {
  char err[256];
  if (shardd__backend_host_create(1, 64 << 20, &d->be, err, sizeof err) != SHARDD_OK)
    abort();
  shardd__backend_host_persist(d->be, SHARDD__PERSIST_ON);
  shardd__registry_init(&d->reg, d->be);
  uv_loop_init(&d->loop);
  if (shardd__fdstore_create(&d->loop, &d->reg, NULL, NULL, &d->fs) != SHARDD_OK)
    abort();
}

/* A crash: the store keeps what it holds. */
static void daemon_crash(daemon_t *d) {
  shardd__fdstore_stop(d->fs);
  shardd__backend_host_persist(d->be, SHARDD__PERSIST_DETACHED);
  uv_run(&d->loop, UV_RUN_DEFAULT);
  shardd__registry_free(&d->reg);
  shardd__fdstore_free(d->fs);
  uv_loop_close(&d->loop);
  d->be->ops->destroy(d->be);
}

static void store_job(void) {
  char err[256];
  daemon_t a;
  shardd__job *job;
  shardd__buffer *b;
  int created;
  daemon_up(&a);
  if (shardd__job_get(&a.reg, "j", 2, 0, &job, err, sizeof err) != SHARDD_OK)
    abort();
  uint64_t bb = shardd__buffer_block_bytes(job, SHARDD_DTYPE_FP32, 1000);
  if (shardd__buffer_slabs_begin(&a.reg, job, 2 * bb, 2, err, sizeof err) != SHARDD_OK ||
      shardd__buffer_register(&a.reg, job, "p", SHARDD_DTYPE_FP32, 1000, &b,
                              &created, err, sizeof err) != SHARDD_OK ||
      shardd__buffer_register(&a.reg, job, "q", SHARDD_DTYPE_FP32, 1000, &b,
                              &created, err, sizeof err) != SHARDD_OK ||
      shardd__buffer_slabs_end(&a.reg, err, sizeof err) != SHARDD_OK ||
      shardd__buffer_register(&a.reg, job, "w", SHARDD_DTYPE_BF16, 300, &b,
                              &created, err, sizeof err) != SHARDD_OK)
    abort();
  shardd__fdstore_touch(a.fs, job);
  daemon_crash(&a);
  pump(1);
}

/* s with each from replaced by to (malloc'd). */
static char *replaced(const char *s, size_t len, const char *from,
                      const char *to) {
  size_t fl = strlen(from), tl = strlen(to), n = 0;
  char *out = malloc(len * (tl > fl ? tl : fl) + 1);
  if (out == NULL)
    abort();
  for (size_t i = 0; i < len;)
    if (fl && i + fl <= len && !memcmp(s + i, from, fl)) {
      memcpy(out + n, to, tl);
      n += tl;
      i += fl;
    } else {
      out[n++] = s[i++];
    }
  out[n] = '\0';
  return out;
}

/* The stored names are the first daemon's ("shardd-r<PREFIX>-<N>", its
 * prefix random): made "shardd-rfz-<N>", so that the seeds' names are
 * those the pool has on every run. */
static char prefix[64];

static void canonical_names(void) {
  for (size_t i = 0; i < nfds && !prefix[0]; i++) {
    const char *n = names[i], *dash = strrchr(n, '-');
    size_t pl = strlen(SHARDD__STORE_REGION_PREFIX);
    if (!strncmp(n, SHARDD__STORE_REGION_PREFIX, pl) && dash &&
        (size_t)(dash - n) > pl && (size_t)(dash - n) - pl < sizeof prefix)
      memcpy(prefix, n + pl, (size_t)(dash - n) - pl);
  }
  if (!prefix[0])
    abort();
  for (size_t i = 0; i < nfds; i++) {
    char *c = replaced(names[i], strlen(names[i]), prefix, "fz");
    free(names[i]);
    names[i] = c;
  }
}

/* Keeps the bytes of each description memfd (slots, journal); finds the
 * newest slot. */
static void save_meta(void) {
  uint64_t best = 0;
  for (size_t i = 0; i < nfds; i++) {
    if (strncmp(names[i], META_PREFIX, strlen(META_PREFIX)) != 0)
      continue;
    off_t len = lseek(fds[i], 0, SEEK_END);
    saved[i] = malloc(len > 0 ? (size_t)len : 1);
    saved_len[i] = len > 0 ? (size_t)len : 0;
    if (saved[i] == NULL ||
        pread(fds[i], saved[i], saved_len[i], 0) != (ssize_t)saved_len[i])
      abort();
    size_t l = strlen(names[i]);
    slot_hdr h;
    if (names[i][l - 1] != 'j' && saved_len[i] >= sizeof h) {
      memcpy(&h, saved[i], sizeof h);
      if (h.gen > best) {
        best = h.gen;
        slot = (int)i;
      }
    }
  }
  if (slot < 0)
    abort();
}

/* After the first daemon's: what each adopting daemon sends the store
 * read (and its descriptors closed) as it comes, as systemd would; left
 * unread, the queue fills and each send waits out its timeout. */
static void *drain(void *arg) {
  (void)arg;
  for (;;) {
    struct pollfd p = {rx, POLLIN, 0};
    if (poll(&p, 1, -1) > 0)
      pump(0);
  }
  return NULL;
}

static void init_once(void) {
  static int done;
  if (done)
    return;
  done = 1;
  snprintf(root, sizeof root, "/tmp/shardd-fuzzf-%d.d", (int)getpid());
  mkdir(root, 0700);
  atexit(fuzz_rm_root);
  char path[128];
  snprintf(path, sizeof path, "%s/notify", root);
  rx = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  if (rx < 0 || bind(rx, (struct sockaddr *)&sa, sizeof sa) != 0)
    abort();
  int big = 4 << 20;
  setsockopt(rx, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
  setenv("NOTIFY_SOCKET", path, 1);
  store_job();
  canonical_names();
  save_meta();
  if (getenv("FUZZ_FDSTORE_PRINT")) { /* the seed: the text as written */
    slot_hdr h;
    memcpy(&h, saved[slot], sizeof h);
    char *t = replaced(saved[slot] + SLOT_TEXT_OFF, h.len, prefix, "fz");
    fputs(t, stdout);
    fflush(stdout);
    exit(0);
  }
  pthread_t t;
  if (pthread_create(&t, NULL, drain, NULL) != 0)
    abort();
  pthread_detach(t);
}

/* Each block of an adopted buffer is read at its first and last byte: a
 * block the description put outside its file's mapping faults here. */
static void touch_blocks(void *value, void *arg) {
  shardd__buffer *b = value;
  volatile unsigned char *sum = arg;
  for (uint32_t r = 0; r < b->world; r++)
    if (b->blocks[r]) {
      const unsigned char *p = b->blocks[r]->ptr;
      *sum ^= p[0] ^ p[b->blocks[r]->bytes - 1];
    }
}

static void on_adopted(void *arg, shardd__job *job, uint64_t step) {
  (void)arg;
  (void)step;
  volatile unsigned char sum = 0;
  shardd__map_each(&job->buffers, touch_blocks, (void *)&sum);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  init_once();
  if (size > SLOT_TEXT_MAX)
    return 0;
  for (size_t i = 0; i < nfds; i++)
    if (saved[i] && pwrite(fds[i], saved[i], saved_len[i], 0) != (ssize_t)saved_len[i])
      abort();
  slot_hdr h;
  memcpy(&h, saved[slot], sizeof h);
  h.len = size;
  h.crc = shardd__crc32c(0, data, size);
  if (pwrite(fds[slot], data, size, SLOT_TEXT_OFF) != (ssize_t)size ||
      pwrite(fds[slot], &h, sizeof h, 0) != (ssize_t)sizeof h)
    abort();
  shardd__fdstore_fd in[MAXFD];
  for (size_t i = 0; i < nfds; i++)
    in[i] = (shardd__fdstore_fd){fcntl(fds[i], F_DUPFD_CLOEXEC, 0), names[i]};
  daemon_t b;
  daemon_up(&b);
  shardd__fdstore_adopt(b.fs, in, nfds, on_adopted, NULL);
  daemon_crash(&b);
  return 0;
}

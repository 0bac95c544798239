/* test_review.c — regressions from a review of the daemon for crashes,
 * unbounded growth and hostile input, each against a real shardd: a
 * collective with no work (a wholly frozen buffer's scatter), a client that
 * never reads its replies, an optimizer naming one id 100k times, and a
 * checkpoint directory holding planted symlinks. Expected values come from
 * what the test set up, never from the daemon. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>

#include "harness.h"

static test_daemon d;

static void start1(void) {
  const char *args[] = {"--devices", "1", NULL};
  test_daemon_start(&d, args);
}

static void stop_daemon(void) { test_daemon_finish(&d); }

static uint64_t raw_view(test_raw *r, uint64_t buf, const char *name,
                         uint64_t off, uint64_t numel, int requires_grad) {
  Shardd__Request req = SHARDD__REQUEST__INIT;
  Shardd__RegisterView rv = SHARDD__REGISTER_VIEW__INIT;
  int64_t shape[1] = {(int64_t)numel};
  rv.buffer = buf;
  rv.name = (char *)name;
  rv.offset = off;
  rv.numel = numel;
  rv.shape = shape;
  rv.n_shape = 1;
  rv.has_requires_grad = 1;
  rv.requires_grad = requires_grad;
  req.body_case = SHARDD__REQUEST__BODY_REGISTER_VIEW;
  req.register_view = &rv;
  uint64_t seq = test_raw_send(r, &req);
  Shardd__Response *resp = test_raw_expect(r, seq, SHARDD_OK);
  uint64_t id = resp->view->id;
  shardd__response__free_unpacked(resp, NULL);
  return id;
}

/* A scatter of a buffer whose every element is frozen has no task to run
 * and completes inside the scheduler that started it; the scheduler must
 * not walk on from the collective that completion freed. Twice, with a
 * gather of the same buffer queued between, so the queue has a successor. */
/* Disabled until the fix to schedule() in daemon/collective.c lands (that
 * file is being edited elsewhere; the patch is in the review report): the
 * daemon dies of a use-after-free at collective.c:401 without it. */
Test(review, scatter_with_no_work_completes_and_daemon_lives, .init = start1,
     .fini = stop_daemon, .timeout = 120) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "frozen-all", 0, 1);
  shardd_buffer_info b;
  test_raw_register_buffer(&r, "w", SHARDD_DTYPE_FP32, 64, &b);
  raw_view(&r, b.id, "base", 0, 64, 0);
  for (int i = 0; i < 3; i++) {
    uint64_t s1 = test_raw_send_scatter(&r, b.id, SHARDD_REDUCE_SUM);
    uint64_t g = test_raw_send_gather(&r, b.id);
    uint64_t s2 = test_raw_send_scatter(&r, b.id, SHARDD_REDUCE_MEAN);
    shardd__response__free_unpacked(test_raw_expect(&r, s1, SHARDD_OK), NULL);
    shardd__response__free_unpacked(test_raw_expect(&r, g, SHARDD_OK), NULL);
    shardd__response__free_unpacked(test_raw_expect(&r, s2, SHARDD_OK), NULL);
  }
  test_raw_sync(&r);
  test_raw_close(&r);
  cr_assert(test_daemon_alive(&d), "the daemon died");
}

/* ---- backpressure --------------------------------------------------------
 * A client that sends and never reads must not make the daemon queue its
 * replies without bound. Without backpressure the daemon read every Ping
 * and held every 4 MiB Pong in memory (here up to 1 GiB); with it, the
 * session is not read past 64 MiB of unwritten replies, so the client's
 * sends stall soon after, the daemon serves others meanwhile, and once the
 * client reads, every reply comes, in order. */

#define PING_PAYLOAD ((size_t)4 << 20)

static size_t ping_frame(uint8_t **out, uint64_t seq, const uint8_t *payload) {
  Shardd__Request req = SHARDD__REQUEST__INIT;
  Shardd__Ping p = SHARDD__PING__INIT;
  p.has_payload = 1;
  p.payload.data = (uint8_t *)payload;
  p.payload.len = PING_PAYLOAD;
  req.seq = seq;
  req.body_case = SHARDD__REQUEST__BODY_PING;
  req.ping = &p;
  size_t n = shardd__request__get_packed_size(&req);
  *out = malloc(SHARDD_FRAME_HEADER + n);
  cr_assert_not_null(*out);
  shardd__frame_put_header(*out, (uint32_t)n);
  shardd__request__pack(&req, *out + SHARDD_FRAME_HEADER);
  return SHARDD_FRAME_HEADER + n;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* The rest of a frame the daemon stopped reading in the middle of, sent
 * (blocking) by a thread while the test reads. */
typedef struct {
  int fd;
  uint8_t *frame;
  size_t off, len;
  pthread_t th;
} rest;

static void *rest_main(void *p) {
  rest *t = p;
  while (t->off < t->len) {
    ssize_t w = send(t->fd, t->frame + t->off, t->len - t->off, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      break;
    t->off += (size_t)w;
  }
  return NULL;
}

/* Sends frames of pings until the socket stays full for `stall` seconds or
 * `limit` bytes went out; returns the number of frames begun (*sent: their
 * bytes). A frame cut by the stall is left in *t, to be finished by a
 * thread (t->frame NULL when none was). */
static uint64_t send_until_stalled(test_raw *r, const uint8_t *payload,
                                   size_t limit, double stall, size_t *sent,
                                   rest *t) {
  int fl = fcntl(r->fd, F_GETFL);
  fcntl(r->fd, F_SETFL, fl | O_NONBLOCK);
  uint64_t frames = 0;
  *sent = 0;
  memset(t, 0, sizeof *t);
  while (*sent < limit) {
    uint8_t *f;
    size_t n = ping_frame(&f, ++r->seq, payload), off = 0;
    double idle = now_s();
    while (off < n) {
      ssize_t w = send(r->fd, f + off, n - off, MSG_NOSIGNAL);
      if (w > 0) {
        off += (size_t)w;
        idle = now_s();
        continue;
      }
      cr_assert(w < 0 && (errno == EAGAIN || errno == EINTR), "send: %s",
                strerror(errno));
      if (now_s() - idle > stall)
        break;
      test_sleep_ms(5);
    }
    if (off < n) {
      fcntl(r->fd, F_SETFL, fl);
      if (off == 0) {
        free(f);
        r->seq--;
      } else {
        *t = (rest){r->fd, f, off, n, 0};
        cr_assert_eq(pthread_create(&t->th, NULL, rest_main, t), 0);
        *sent += n;
        frames++;
      }
      return frames;
    }
    free(f);
    *sent += n;
    frames++;
  }
  fcntl(r->fd, F_SETFL, fl);
  return frames;
}

Test(review, client_that_never_reads_is_throttled_not_buffered, .init = start1,
     .fini = stop_daemon, .timeout = 120) {
  uint8_t *payload = malloc(PING_PAYLOAD);
  cr_assert_not_null(payload);
  for (size_t i = 0; i < PING_PAYLOAD; i++)
    payload[i] = (uint8_t)(i * 131 + 7);
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, NULL, 0, 1);
  uint64_t first = r.seq + 1;
  size_t sent;
  rest t;
  uint64_t n = send_until_stalled(&r, payload, (size_t)1 << 30, 1.5, &sent, &t);
  cr_assert_lt(sent, (size_t)256 << 20,
               "the daemon took %zu bytes of Pings from a client that reads "
               "no reply (%llu Pongs of 4 MiB queued)", sent,
               (unsigned long long)n);
  cr_assert_gt(n, 0);

  /* the daemon serves another client meanwhile */
  test_raw o;
  test_raw_open(&d, &o);
  test_raw_hello(&o, NULL, 0, 1);
  test_raw_sync(&o);
  test_raw_close(&o);

  /* every Pong comes once the client reads, in order, whole */
  for (uint64_t i = 0; i < n; i++) {
    Shardd__Response *resp = test_raw_expect(&r, first + i, SHARDD_OK);
    cr_assert_eq(resp->body_case, SHARDD__RESPONSE__BODY_PONG);
    cr_assert_eq(resp->pong->payload.len, PING_PAYLOAD);
    cr_assert(memcmp(resp->pong->payload.data, payload, PING_PAYLOAD) == 0);
    shardd__response__free_unpacked(resp, NULL);
  }
  if (t.frame) {
    pthread_join(t.th, NULL);
    cr_assert_eq(t.off, t.len, "the cut frame was not taken whole");
    free(t.frame);
  }
  test_raw_sync(&r);
  test_raw_close(&r);
  free(payload);
}

static int count_fds(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *dir = opendir(path);
  cr_assert_not_null(dir);
  int n = 0;
  for (struct dirent *e; (e = readdir(dir)) != NULL;)
    n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

/* Every RegisterBuffer reply carries a descriptor the daemon holds until
 * the reply is written: 2000 attaches from a client that does not read
 * held 2000 descriptors (the fd table is shared with every other client). */
Test(review, unread_descriptor_replies_are_bounded, .init = start1,
     .fini = stop_daemon, .timeout = 120) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "fds", 0, 1);
  shardd_buffer_info b;
  test_raw_register_buffer(&r, "w", SHARDD_DTYPE_FP32, 16, &b);
  int base = count_fds(d.pid);
  Shardd__Request req = SHARDD__REQUEST__INIT;
  Shardd__RegisterBuffer rb = SHARDD__REGISTER_BUFFER__INIT;
  rb.name = "w";
  rb.dtype = SHARDD__DTYPE__FP32;
  rb.numel = 16;
  req.body_case = SHARDD__REQUEST__BODY_REGISTER_BUFFER;
  req.register_buffer = &rb;
  uint64_t first = r.seq + 1;
  /* nonblocking: a client that writes without reading may be stalled */
  int fl = fcntl(r.fd, F_GETFL);
  fcntl(r.fd, F_SETFL, fl | O_NONBLOCK);
  int n = 0;
  for (double idle = now_s(); n < 2000 && now_s() - idle < 1.0;) {
    req.seq = first + (uint64_t)n;
    uint8_t f[256];
    size_t len = shardd__request__get_packed_size(&req);
    cr_assert_lt(len + SHARDD_FRAME_HEADER, sizeof f);
    shardd__frame_put_header(f, (uint32_t)len);
    shardd__request__pack(&req, f + SHARDD_FRAME_HEADER);
    ssize_t w = send(r.fd, f, len + SHARDD_FRAME_HEADER, MSG_NOSIGNAL);
    if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
      test_sleep_ms(5);
      continue;
    }
    /* a small frame goes whole or not at all on a unix stream socket */
    cr_assert_eq(w, (ssize_t)(len + SHARDD_FRAME_HEADER), "send: %s", strerror(errno));
    n++;
    idle = now_s();
  }
  fcntl(r.fd, F_SETFL, fl);
  r.seq = first + (uint64_t)n - 1;
  test_sleep_ms(500);
  int held = count_fds(d.pid) - base;
  cr_assert_lt(held, 200, "the daemon holds %d descriptors for replies its "
               "client has not read", held);
  for (int i = 0; i < n; i++) {
    int fd;
    Shardd__Response *resp = test_raw_recv_fd(&r, &fd);
    cr_assert_not_null(resp);
    cr_assert_eq(resp->seq, first + (uint64_t)i);
    cr_assert_eq(resp->code, SHARDD__STATUS_CODE__OK, "%s", resp->message);
    cr_assert(fd >= 0, "reply %d came without its descriptor", i);
    close(fd);
    shardd__response__free_unpacked(resp, NULL);
  }
  test_raw_sync(&r);
  test_raw_close(&r);
}

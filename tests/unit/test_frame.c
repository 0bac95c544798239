/* test_frame.c — the length-prefixed framing shared by daemon and client:
 * the incremental reader (split, concatenated, truncated, oversized, empty
 * and garbage input) and the blocking send/receive over a socketpair,
 * including SCM_RIGHTS descriptors and EOF. Frames are built by hand here
 * (little-endian length written byte by byte), not with the module. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "frame.h"

#define MAXF 1024u

static shardd__frame_reader r;

static void setup(void) { shardd__frame_reader_init(&r, MAXF); }
static void teardown(void) { shardd__frame_reader_free(&r); }

TestSuite(frame, .init = setup, .fini = teardown);

/* Writes the frame [len LE][payload] at out; returns its size. */
static size_t mk(uint8_t *out, const void *payload, uint32_t len) {
  out[0] = (uint8_t)(len & 0xff);
  out[1] = (uint8_t)((len >> 8) & 0xff);
  out[2] = (uint8_t)((len >> 16) & 0xff);
  out[3] = (uint8_t)((len >> 24) & 0xff);
  if (len)
    memcpy(out + 4, payload, len);
  return 4 + (size_t)len;
}

static void expect_frame(const void *want, size_t wlen) {
  const uint8_t *p = NULL;
  size_t n = 99;
  cr_assert_eq(shardd__frame_reader_next(&r, &p, &n), SHARDD_OK);
  cr_assert_not_null(p, "a complete frame is held");
  cr_assert_eq(n, wlen);
  cr_assert(memcmp(p, want, wlen) == 0);
}

static void expect_none(void) {
  const uint8_t *p = (const uint8_t *)"x";
  size_t n = 99;
  cr_assert_eq(shardd__frame_reader_next(&r, &p, &n), SHARDD_OK);
  cr_assert_null(p);
  cr_assert_eq(n, 0);
}

Test(frame, put_header_is_little_endian) {
  uint8_t h[4];
  shardd__frame_put_header(h, 0x04030201u);
  cr_expect(h[0] == 1 && h[1] == 2 && h[2] == 3 && h[3] == 4);
  shardd__frame_put_header(h, 0);
  cr_expect(h[0] == 0 && h[1] == 0 && h[2] == 0 && h[3] == 0);
}

Test(frame, nothing_fed) {
  expect_none();
  cr_expect_eq(shardd__frame_reader_pending(&r), 0);
}

Test(frame, one_frame) {
  uint8_t buf[64];
  size_t n = mk(buf, "hello", 5);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, n), SHARDD_OK);
  expect_frame("hello", 5);
  cr_expect_eq(shardd__frame_reader_pending(&r), 0);
  expect_none();
}

Test(frame, split_byte_at_a_time) {
  uint8_t payload[300], buf[400];
  for (int i = 0; i < 300; i++)
    payload[i] = (uint8_t)(i * 7 + 3);
  size_t n = mk(buf, payload, sizeof payload);
  for (size_t i = 0; i < n; i++) {
    expect_none();
    cr_assert_eq(shardd__frame_reader_pending(&r), i);
    cr_assert_eq(shardd__frame_reader_feed(&r, buf + i, 1), SHARDD_OK);
  }
  expect_frame(payload, sizeof payload);
  expect_none();
}

Test(frame, split_byte_at_a_time_over_several_frames) {
  /* three frames, fed one byte at a time; each is taken as soon as whole */
  uint8_t buf[64];
  size_t n = mk(buf, "ab", 2);
  n += mk(buf + n, "", 0);
  n += mk(buf + n, "cdef", 4);
  const char *want[] = {"ab", "", "cdef"};
  size_t wlen[] = {2, 0, 4}, ends[] = {6, 10, 18};
  int got = 0;
  for (size_t i = 0; i < n; i++) {
    cr_assert_eq(shardd__frame_reader_feed(&r, buf + i, 1), SHARDD_OK);
    if (i + 1 == ends[got]) {
      expect_frame(want[got], wlen[got]);
      got++;
    }
    expect_none();
  }
  cr_expect_eq(got, 3);
}

Test(frame, concatenated_in_one_feed) {
  uint8_t buf[4096];
  size_t n = 0;
  char text[16][32];
  for (int i = 0; i < 16; i++) {
    snprintf(text[i], sizeof text[i], "frame number %d", i);
    n += mk(buf + n, text[i], (uint32_t)strlen(text[i]));
  }
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, n), SHARDD_OK);
  for (int i = 0; i < 16; i++) {
    expect_frame(text[i], strlen(text[i]));
  }
  expect_none();
  cr_expect_eq(shardd__frame_reader_pending(&r), 0);
}

Test(frame, concatenated_with_a_partial_tail) {
  uint8_t buf[256];
  size_t n = mk(buf, "one", 3);
  size_t second = mk(buf + n, "second!", 7);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, n + 5), SHARDD_OK);
  expect_frame("one", 3);
  expect_none();
  cr_expect_eq(shardd__frame_reader_pending(&r), 5);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf + n + 5, second - 5),
               SHARDD_OK);
  expect_frame("second!", 7);
  expect_none();
}

Test(frame, payload_valid_until_next_call) {
  /* the payload handed out stays intact while nothing else is called, even
   * after the reader has compacted itself on an earlier feed */
  uint8_t buf[64];
  size_t n = mk(buf, "AAAA", 4);
  n += mk(buf + n, "BBBB", 4);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, n), SHARDD_OK);
  expect_frame("AAAA", 4);
  const uint8_t *p;
  size_t len;
  cr_assert_eq(shardd__frame_reader_next(&r, &p, &len), SHARDD_OK);
  cr_assert_not_null(p);
  cr_assert(memcmp(p, "BBBB", 4) == 0);
  n = mk(buf, "CCCC", 4);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, n), SHARDD_OK);
  expect_frame("CCCC", 4);
}

Test(frame, truncated_header_only) {
  uint8_t buf[16];
  mk(buf, "abcd", 4);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, 4), SHARDD_OK);
  expect_none();
  cr_expect_eq(shardd__frame_reader_pending(&r), 4);
}

Test(frame, truncated_partial_header) {
  uint8_t buf[16];
  mk(buf, "abcd", 4);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, 3), SHARDD_OK);
  expect_none();
  cr_expect_eq(shardd__frame_reader_pending(&r), 3);
}

Test(frame, truncated_partial_payload) {
  uint8_t buf[128];
  uint8_t payload[100];
  memset(payload, 0x5a, sizeof payload);
  mk(buf, payload, 100);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, 4 + 99), SHARDD_OK);
  expect_none();
  expect_none();
  cr_expect_eq(shardd__frame_reader_pending(&r), 103);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf + 103, 1), SHARDD_OK);
  expect_frame(payload, 100);
}

Test(frame, zero_length_frame) {
  uint8_t buf[8];
  size_t n = mk(buf, NULL, 0);
  cr_assert_eq(n, 4);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, n), SHARDD_OK);
  const uint8_t *p = NULL;
  size_t len = 99;
  cr_assert_eq(shardd__frame_reader_next(&r, &p, &len), SHARDD_OK);
  cr_assert_not_null(p, "an empty frame is a frame, not 'need more'");
  cr_assert_eq(len, 0);
  expect_none();
}

Test(frame, exactly_max_frame_is_accepted) {
  uint8_t *buf = malloc(4 + MAXF);
  uint8_t *payload = malloc(MAXF);
  for (unsigned i = 0; i < MAXF; i++)
    payload[i] = (uint8_t)i;
  size_t n = mk(buf, payload, MAXF);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, n), SHARDD_OK);
  expect_frame(payload, MAXF);
  free(buf);
  free(payload);
}

typedef struct {
  uint32_t len;
} big_row;

ParameterizedTestParameters(frame, oversized_header) {
  static big_row rows[] = {{MAXF + 1}, {MAXF * 2}, {0x7fffffffu}, {0xffffffffu}};
  return cr_make_param_array(big_row, rows, sizeof rows / sizeof rows[0]);
}

ParameterizedTest(big_row *row, frame, oversized_header) {
  uint8_t h[4] = {(uint8_t)row->len, (uint8_t)(row->len >> 8),
                  (uint8_t)(row->len >> 16), (uint8_t)(row->len >> 24)};
  cr_assert_eq(shardd__frame_reader_feed(&r, h, 4), SHARDD_OK);
  const uint8_t *p = (const uint8_t *)"x";
  size_t len;
  cr_expect_eq(shardd__frame_reader_next(&r, &p, &len),
               SHARDD_E_FRAME_TOO_LARGE, "header announcing %u bytes",
               row->len);
  cr_expect_null(p);
  /* refused on the header alone: the daemon never buffers the body */
  cr_expect_eq(shardd__frame_reader_next(&r, &p, &len),
               SHARDD_E_FRAME_TOO_LARGE, "the refusal is sticky");
}

Test(frame, oversized_after_a_good_frame) {
  uint8_t buf[32];
  size_t n = mk(buf, "ok", 2);
  uint32_t big = MAXF + 1;
  buf[n++] = (uint8_t)big;
  buf[n++] = (uint8_t)(big >> 8);
  buf[n++] = 0;
  buf[n++] = 0;
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, n), SHARDD_OK);
  expect_frame("ok", 2);
  const uint8_t *p;
  size_t len;
  cr_expect_eq(shardd__frame_reader_next(&r, &p, &len),
               SHARDD_E_FRAME_TOO_LARGE);
}

Test(frame, garbage) {
  /* random bytes read as frames: either a frame within the limit, a
   * refusal, or "need more" — never a read past what was fed (ASan) */
  uint8_t junk[4096];
  uint32_t x = 12345;
  for (size_t i = 0; i < sizeof junk; i++) {
    x = x * 1103515245u + 12345u;
    junk[i] = (uint8_t)(x >> 16);
  }
  cr_assert_eq(shardd__frame_reader_feed(&r, junk, sizeof junk), SHARDD_OK);
  const uint8_t *p;
  size_t len;
  shardd_err rc = shardd__frame_reader_next(&r, &p, &len);
  uint32_t announced = (uint32_t)junk[0] | (uint32_t)junk[1] << 8 |
                       (uint32_t)junk[2] << 16 | (uint32_t)junk[3] << 24;
  if (announced > MAXF) {
    cr_expect_eq(rc, SHARDD_E_FRAME_TOO_LARGE);
  } else {
    cr_expect_eq(rc, SHARDD_OK);
    cr_expect_eq(len, announced);
  }
}

Test(frame, garbage_small_lengths) {
  /* a stream of small garbage lengths parses into exactly the frames the
   * lengths describe */
  uint8_t buf[2048];
  size_t n = 0;
  uint32_t lens[] = {0, 1, 17, 255, 3, 0, 200};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    uint8_t body[256];
    memset(body, (int)(0xa0 + i), sizeof body);
    n += mk(buf + n, body, lens[i]);
  }
  /* feed in uneven pieces */
  for (size_t off = 0; off < n;) {
    size_t k = off % 13 + 1;
    k = k > n - off ? n - off : k;
    cr_assert_eq(shardd__frame_reader_feed(&r, buf + off, k), SHARDD_OK);
    off += k;
  }
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    uint8_t body[256];
    memset(body, (int)(0xa0 + i), sizeof body);
    expect_frame(body, lens[i]);
  }
  expect_none();
}

Test(frame, reader_does_not_grow_without_bound) {
  /* many small frames, each taken before the next feed: the buffer stays at
   * about one frame plus one read */
  uint8_t buf[64];
  size_t n = mk(buf, "0123456789", 10);
  for (int i = 0; i < 100000; i++) {
    cr_assert_eq(shardd__frame_reader_feed(&r, buf, n), SHARDD_OK);
    expect_frame("0123456789", 10);
  }
  cr_expect_leq(r.cap, 4096);
}

/* ---- blocking I/O over a socketpair ----------------------------------- */

static int sp[2] = {-1, -1};

static void sock_setup(void) {
  setup();
  signal(SIGPIPE, SIG_IGN);
  cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp), 0);
}

static void sock_teardown(void) {
  teardown();
  if (sp[0] >= 0)
    close(sp[0]);
  if (sp[1] >= 0)
    close(sp[1]);
  sp[0] = sp[1] = -1;
}

/* Sends bytes with fds attached by hand (sendmsg, SCM_RIGHTS). */
static void send_with_fds(int fd, const void *data, size_t n, const int *fds,
                          int nfds) {
  union {
    struct cmsghdr align;
    char space[CMSG_SPACE(sizeof(int) * 8)];
  } ctl;
  memset(&ctl, 0, sizeof ctl);
  struct iovec iov = {(void *)data, n};
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (nfds > 0) {
    msg.msg_control = ctl.space;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
  }
  cr_assert_eq(sendmsg(fd, &msg, 0), (ssize_t)n, "sendmsg: %s",
               strerror(errno));
}

/* Reads exactly n bytes. */
static void read_exact(int fd, void *out, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t k = read(fd, (char *)out + got, n - got);
    cr_assert_gt(k, 0, "read: %s", k < 0 ? strerror(errno) : "EOF");
    got += (size_t)k;
  }
}

Test(frame, send_writes_header_and_payload, .init = sock_setup,
     .fini = sock_teardown) {
  char err[128] = "";
  cr_assert_eq(shardd__frame_send(sp[0], "abc", 3, err, sizeof err), SHARDD_OK,
               "%s", err);
  uint8_t got[7];
  read_exact(sp[1], got, 7);
  uint8_t want[7];
  mk(want, "abc", 3);
  cr_expect(memcmp(got, want, 7) == 0);
}

Test(frame, send_recv_round_trip, .init = sock_setup, .fini = sock_teardown) {
  char err[128] = "";
  uint8_t payload[1000];
  for (int i = 0; i < 1000; i++)
    payload[i] = (uint8_t)(i ^ 0x55);
  cr_assert_eq(shardd__frame_send(sp[0], payload, sizeof payload, err,
                                  sizeof err),
               SHARDD_OK);
  cr_assert_eq(shardd__frame_send(sp[0], NULL, 0, err, sizeof err), SHARDD_OK);
  const uint8_t *p;
  size_t len;
  int fds[4], nfds = -1;
  cr_assert_eq(shardd__frame_recv(sp[1], &r, &p, &len, fds, 4, &nfds, err,
                                  sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(len, sizeof payload);
  cr_assert(memcmp(p, payload, len) == 0);
  cr_expect_eq(nfds, 0);
  cr_assert_eq(shardd__frame_recv(sp[1], &r, &p, &len, fds, 4, &nfds, err,
                                  sizeof err),
               SHARDD_OK, "%s", err);
  cr_expect_not_null(p);
  cr_expect_eq(len, 0);
}

Test(frame, recv_large_frame_in_many_reads, .init = sock_setup,
     .fini = sock_teardown) {
  /* bigger than frame_recv's 64 KiB read buffer and the socket buffer: a
   * child writes while we read */
  shardd__frame_reader_free(&r);
  shardd__frame_reader_init(&r, SHARDD_MAX_FRAME);
  size_t n = 3u << 20;
  uint8_t *payload = malloc(n);
  for (size_t i = 0; i < n; i++)
    payload[i] = (uint8_t)(i * 31 + (i >> 12));
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    close(sp[1]);
    char err[128];
    _exit(shardd__frame_send(sp[0], payload, n, err, sizeof err) == SHARDD_OK
              ? 0
              : 1);
  }
  const uint8_t *p;
  size_t len;
  int nfds;
  char err[128] = "";
  cr_assert_eq(shardd__frame_recv(sp[1], &r, &p, &len, NULL, 0, &nfds, err,
                                  sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(len, n);
  cr_assert(memcmp(p, payload, n) == 0);
  int st;
  waitpid(pid, &st, 0);
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  free(payload);
}

Test(frame, recv_delivers_scm_rights_fd, .init = sock_setup,
     .fini = sock_teardown) {
  /* a pipe's write end travels with the frame; writing to the received fd
   * must reach our read end */
  int pipefd[2];
  cr_assert_eq(pipe(pipefd), 0);
  uint8_t buf[64];
  size_t n = mk(buf, "with-fd", 7);
  send_with_fds(sp[0], buf, n, &pipefd[1], 1);
  close(pipefd[1]);

  const uint8_t *p;
  size_t len;
  int fds[4] = {-1, -1, -1, -1}, nfds = -1;
  char err[128] = "";
  cr_assert_eq(shardd__frame_recv(sp[1], &r, &p, &len, fds, 4, &nfds, err,
                                  sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(len, 7);
  cr_assert(memcmp(p, "with-fd", 7) == 0);
  cr_assert_eq(nfds, 1);
  cr_assert_geq(fds[0], 0);
  cr_expect(fcntl(fds[0], F_GETFD) & FD_CLOEXEC, "received with CLOEXEC");
  cr_assert_eq(write(fds[0], "ping", 4), 4);
  close(fds[0]);
  char got[8] = "";
  read_exact(pipefd[0], got, 4);
  cr_expect(memcmp(got, "ping", 4) == 0);
  char c;
  cr_expect_eq(read(pipefd[0], &c, 1), 0, "the only writer was closed");
  close(pipefd[0]);
}

Test(frame, recv_delivers_several_fds_and_a_memfd, .init = sock_setup,
     .fini = sock_teardown) {
  /* the way the host backend hands out regions: a memfd whose bytes the
   * receiver can map and read */
  int mfd = memfd_create("test-frame", MFD_CLOEXEC);
  cr_assert_geq(mfd, 0);
  cr_assert_eq(write(mfd, "region bytes", 12), 12);
  int dn = open("/dev/null", O_WRONLY | O_CLOEXEC);
  int sendfds[2] = {mfd, dn};
  uint8_t buf[16];
  size_t n = mk(buf, "two", 3);
  send_with_fds(sp[0], buf, n, sendfds, 2);
  close(mfd);
  close(dn);

  const uint8_t *p;
  size_t len;
  int fds[4], nfds = -1;
  char err[128] = "";
  cr_assert_eq(shardd__frame_recv(sp[1], &r, &p, &len, fds, 4, &nfds, err,
                                  sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(nfds, 2);
  char got[16] = "";
  cr_assert_eq(pread(fds[0], got, 12, 0), 12);
  cr_expect(memcmp(got, "region bytes", 12) == 0);
  cr_expect_eq(write(fds[1], "x", 1), 1);
  close(fds[0]);
  close(fds[1]);
}

Test(frame, recv_closes_fds_beyond_maxfds, .init = sock_setup,
     .fini = sock_teardown) {
  int pipefd[2];
  cr_assert_eq(pipe(pipefd), 0);
  int sendfds[3] = {pipefd[1], pipefd[1], pipefd[1]};
  uint8_t buf[16];
  size_t n = mk(buf, "3", 1);
  send_with_fds(sp[0], buf, n, sendfds, 3);
  close(pipefd[1]);

  const uint8_t *p;
  size_t len;
  int fds[1] = {-1}, nfds = -1;
  char err[128] = "";
  cr_assert_eq(shardd__frame_recv(sp[1], &r, &p, &len, fds, 1, &nfds, err,
                                  sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(nfds, 1);
  close(fds[0]);
  /* if the two extras had been kept open the pipe would have writers left */
  char c;
  cr_expect_eq(read(pipefd[0], &c, 1), 0, "extra descriptors were closed");
  close(pipefd[0]);
}

Test(frame, fd_belongs_to_its_own_frame, .init = sock_setup,
     .fini = sock_teardown) {
  /* frame A (no fd) and frame B (with an fd) queued back to back: the fd
   * must come with B, not with A, even though one read could take both */
  int pipefd[2];
  cr_assert_eq(pipe(pipefd), 0);
  uint8_t a[16], b[16];
  size_t na = mk(a, "A", 1), nb = mk(b, "B", 1);
  send_with_fds(sp[0], a, na, NULL, 0);
  send_with_fds(sp[0], b, nb, &pipefd[1], 1);
  close(pipefd[1]);

  const uint8_t *p;
  size_t len;
  int fds[4], nfds = -1;
  char err[128] = "";
  cr_assert_eq(shardd__frame_recv(sp[1], &r, &p, &len, fds, 4, &nfds, err,
                                  sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(len, 1);
  cr_assert_eq(p[0], 'A');
  int nfds_a = nfds;
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  cr_assert_eq(shardd__frame_recv(sp[1], &r, &p, &len, fds, 4, &nfds, err,
                                  sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(len, 1);
  cr_assert_eq(p[0], 'B');
  int nfds_b = nfds;
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  close(pipefd[0]);
  cr_expect_eq(nfds_a, 0, "frame A carried no descriptor");
  cr_expect_eq(nfds_b, 1, "frame B's descriptor arrives with B");
}

Test(frame, recv_eof_is_closed, .init = sock_setup, .fini = sock_teardown) {
  close(sp[0]);
  sp[0] = -1;
  const uint8_t *p;
  size_t len;
  int nfds;
  char err[128] = "";
  cr_expect_eq(shardd__frame_recv(sp[1], &r, &p, &len, NULL, 0, &nfds, err,
                                  sizeof err),
               SHARDD_E_CLOSED);
  cr_expect_neq(err[0], '\0', "a reason is given");
}

Test(frame, recv_eof_mid_frame_is_closed, .init = sock_setup,
     .fini = sock_teardown) {
  uint8_t buf[64];
  size_t n = mk(buf, "truncated payload", 17);
  cr_assert_eq(write(sp[0], buf, n - 5), (ssize_t)(n - 5));
  close(sp[0]);
  sp[0] = -1;
  const uint8_t *p;
  size_t len;
  int nfds;
  char err[128] = "";
  cr_expect_eq(shardd__frame_recv(sp[1], &r, &p, &len, NULL, 0, &nfds, err,
                                  sizeof err),
               SHARDD_E_CLOSED);
}

Test(frame, recv_oversized_is_refused, .init = sock_setup,
     .fini = sock_teardown) {
  uint8_t h[4];
  uint32_t big = MAXF + 1;
  h[0] = (uint8_t)big;
  h[1] = (uint8_t)(big >> 8);
  h[2] = h[3] = 0;
  cr_assert_eq(write(sp[0], h, 4), 4);
  const uint8_t *p;
  size_t len;
  int nfds;
  char err[128] = "";
  cr_expect_eq(shardd__frame_recv(sp[1], &r, &p, &len, NULL, 0, &nfds, err,
                                  sizeof err),
               SHARDD_E_FRAME_TOO_LARGE);
  cr_expect_neq(err[0], '\0');
}

Test(frame, send_to_closed_peer_is_closed, .init = sock_setup,
     .fini = sock_teardown) {
  close(sp[1]);
  sp[1] = -1;
  char err[128] = "";
  shardd_err rc = shardd__frame_send(sp[0], "x", 1, err, sizeof err);
  cr_expect_eq(rc, SHARDD_E_CLOSED, "got %s (%s)", shardd_err_name(rc), err);
}

/* ---- what the daemon charges to its partial-frame budget ---------------- */

/* need: the bytes the reader will hold once the frame it is receiving is
 * whole, counted from the headers written here. */
Test(frame, need_counts_the_announced_frame) {
  uint8_t buf[600] = {0};
  cr_expect_eq(shardd__frame_reader_need(&r), 0);
  mk(buf, NULL, 0);
  buf[0] = 200; /* header announcing 200 bytes; 10 of them sent */
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, 4 + 10), SHARDD_OK);
  cr_expect_eq(shardd__frame_reader_need(&r), 4 + 200);
  expect_none();
  cr_expect_eq(shardd__frame_reader_need(&r), 4 + 200);
}

Test(frame, need_of_a_part_header_is_its_bytes) {
  uint8_t h[2] = {7, 0};
  cr_assert_eq(shardd__frame_reader_feed(&r, h, 2), SHARDD_OK);
  cr_expect_eq(shardd__frame_reader_need(&r), 2);
}

/* Whole frames not yet handed out count as they are, then the partial
 * frame behind them at its announced size. */
Test(frame, need_adds_whole_frames_before_the_partial_one) {
  uint8_t buf[64];
  size_t a = mk(buf, "abc", 3);
  buf[a] = 50; /* then a header for 50 bytes, 2 of them */
  buf[a + 1] = buf[a + 2] = buf[a + 3] = 0;
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, a + 4 + 2), SHARDD_OK);
  cr_expect_eq(shardd__frame_reader_need(&r), a + 4 + 50);
  expect_frame("abc", 3);
  cr_expect_eq(shardd__frame_reader_need(&r), 4 + 50);
}

Test(frame, need_is_zero_once_everything_is_handed_out) {
  uint8_t buf[64];
  size_t a = mk(buf, "abc", 3);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, a), SHARDD_OK);
  cr_expect_eq(shardd__frame_reader_need(&r), a);
  expect_frame("abc", 3);
  cr_expect_eq(shardd__frame_reader_need(&r), 0);
}

/* An oversized header is what next() refuses; need charges only the
 * bytes there are, never the 4 GiB it announces. */
Test(frame, need_of_an_oversized_header_is_the_bytes_held) {
  uint8_t h[6] = {0xff, 0xff, 0xff, 0xff, 1, 2};
  cr_assert_eq(shardd__frame_reader_feed(&r, h, 6), SHARDD_OK);
  cr_expect_eq(shardd__frame_reader_need(&r), 6);
}

/* trim gives a big buffer back once nothing is pending, and the reader
 * works as before afterwards; with bytes pending it keeps them. */
Test(frame, trim_releases_a_drained_big_buffer) {
  shardd__frame_reader big;
  shardd__frame_reader_init(&big, 1u << 20);
  size_t len = 300000;
  uint8_t *f = malloc(4 + len + 4);
  cr_assert_not_null(f);
  memset(f + 4, 0x5a, len);
  mk(f, f + 4, (uint32_t)len);
  cr_assert_eq(shardd__frame_reader_feed(&big, f, 4 + len + 2), SHARDD_OK);
  const uint8_t *p;
  size_t n;
  cr_assert_eq(shardd__frame_reader_next(&big, &p, &n), SHARDD_OK);
  cr_assert_eq(n, len);
  shardd__frame_reader_trim(&big); /* 2 bytes of the next header pending */
  cr_expect_not_null(big.buf, "trim dropped pending bytes");
  cr_expect_eq(shardd__frame_reader_pending(&big), 2);
  shardd__frame_reader_free(&big);

  shardd__frame_reader_init(&big, 1u << 20);
  cr_assert_eq(shardd__frame_reader_feed(&big, f, 4 + len), SHARDD_OK);
  cr_assert_eq(shardd__frame_reader_next(&big, &p, &n), SHARDD_OK);
  cr_assert_eq(n, len);
  shardd__frame_reader_trim(&big);
  cr_expect_null(big.buf, "a drained %zu-byte buffer was kept", big.cap);
  cr_expect_eq(big.cap, 0);
  uint8_t small[16];
  size_t k = mk(small, "hi", 2);
  cr_assert_eq(shardd__frame_reader_feed(&big, small, k), SHARDD_OK);
  cr_assert_eq(shardd__frame_reader_next(&big, &p, &n), SHARDD_OK);
  cr_assert(n == 2 && memcmp(p, "hi", 2) == 0);
  shardd__frame_reader_free(&big);
  free(f);
}

/* An idle session keeps no more than a small buffer: a 64 KiB read of
 * pipelined small frames left 64-128 KiB behind every session that sent
 * one (trim kept anything up to 128 KiB), 20-45 MiB for one uid's 256
 * idle connections that no budget counted. */
Test(frame, trim_leaves_a_drained_reader_a_small_buffer_at_most) {
  static uint8_t burst[65536];
  size_t n = 0, frames = 0;
  while (n + 4 + 100 <= sizeof burst) {
    uint8_t body[100];
    memset(body, (int)frames, sizeof body);
    n += mk(burst + n, body, sizeof body);
    frames++;
  }
  cr_assert_eq(shardd__frame_reader_feed(&r, burst, n), SHARDD_OK);
  for (size_t i = 0; i < frames; i++) {
    const uint8_t *p;
    size_t len;
    cr_assert_eq(shardd__frame_reader_next(&r, &p, &len), SHARDD_OK);
    cr_assert(p != NULL && len == 100 && p[0] == (uint8_t)i);
  }
  expect_none();
  shardd__frame_reader_trim(&r);
  cr_expect_leq(r.cap, 8192, "a drained reader kept %zu bytes", r.cap);
  uint8_t small[16];
  size_t k = mk(small, "hi", 2);
  cr_assert_eq(shardd__frame_reader_feed(&r, small, k), SHARDD_OK);
  expect_frame("hi", 2);
}

/* A few pending bytes (part of the next header) are moved out of the big
 * buffer into a small one, and the frame they begin completes as before. */
Test(frame, trim_moves_a_small_tail_to_a_small_buffer) {
  static uint8_t burst[65536 + 2];
  size_t n = 0, frames = 0;
  while (n + 4 + 200 <= 65536) {
    uint8_t body[200];
    memset(body, 0x11, sizeof body);
    n += mk(burst + n, body, sizeof body);
    frames++;
  }
  uint8_t next[8];
  size_t k = mk(next, "tail", 4);
  memcpy(burst + n, next, 2); /* half of the next frame's header */
  cr_assert_eq(shardd__frame_reader_feed(&r, burst, n + 2), SHARDD_OK);
  for (size_t i = 0; i < frames; i++) {
    const uint8_t *p;
    size_t len;
    cr_assert_eq(shardd__frame_reader_next(&r, &p, &len), SHARDD_OK);
    cr_assert(p != NULL && len == 200);
  }
  expect_none();
  shardd__frame_reader_trim(&r);
  cr_expect_leq(r.cap, 8192, "2 pending bytes kept a %zu-byte buffer", r.cap);
  cr_expect_eq(shardd__frame_reader_pending(&r), 2);
  cr_expect_eq(shardd__frame_reader_need(&r), 2);
  cr_assert_eq(shardd__frame_reader_feed(&r, next + 2, k - 2), SHARDD_OK);
  expect_frame("tail", 4);
}

/* The busy case stays allocation-free: small frames, each trimmed after
 * it is handled as the daemon does, reuse one buffer. */
Test(frame, trim_keeps_the_buffer_of_small_frames) {
  uint8_t buf[64];
  size_t n = mk(buf, "0123456789", 10);
  cr_assert_eq(shardd__frame_reader_feed(&r, buf, n), SHARDD_OK);
  expect_frame("0123456789", 10);
  shardd__frame_reader_trim(&r);
  const uint8_t *first = r.buf;
  cr_assert_not_null(first);
  for (int i = 0; i < 1000; i++) {
    cr_assert_eq(shardd__frame_reader_feed(&r, buf, n), SHARDD_OK);
    expect_frame("0123456789", 10);
    shardd__frame_reader_trim(&r);
    cr_assert_eq(r.buf, first, "frame %d got a new buffer", i);
  }
}

/* A big frame arriving in 64 KiB reads grows the buffer to the frame's
 * size, not to the next power of two past it (a 300,000-byte frame held
 * 512 KiB; a 1 MiB one 2 MiB). */
Test(frame, a_big_frame_grows_the_buffer_to_its_size_not_past_it) {
  shardd__frame_reader big;
  shardd__frame_reader_init(&big, 1u << 20);
  size_t len = 300000, total = 4 + len;
  uint8_t *f = malloc(total);
  cr_assert_not_null(f);
  memset(f + 4, 0x3c, len);
  mk(f, f + 4, (uint32_t)len);
  for (size_t off = 0; off < total; off += 65536) {
    size_t k = total - off < 65536 ? total - off : 65536;
    cr_assert_eq(shardd__frame_reader_feed(&big, f + off, k), SHARDD_OK);
    cr_assert_leq(big.cap, total, "%zu bytes of a %zu-byte frame held a "
                  "%zu-byte buffer", off + k, total, big.cap);
  }
  const uint8_t *p;
  size_t n;
  cr_assert_eq(shardd__frame_reader_next(&big, &p, &n), SHARDD_OK);
  cr_assert(n == len && p[0] == 0x3c && p[len - 1] == 0x3c);
  /* the next frame, arriving with the end of this one, still fits */
  shardd__frame_reader_free(&big);
  shardd__frame_reader_init(&big, 1u << 20);
  uint8_t *two = malloc(total + 8);
  cr_assert_not_null(two);
  memcpy(two, f, total);
  size_t k2 = mk(two + total, "ok", 2);
  cr_assert_eq(shardd__frame_reader_feed(&big, two, 65536), SHARDD_OK);
  cr_assert_eq(shardd__frame_reader_feed(&big, two + 65536, total + k2 - 65536),
               SHARDD_OK);
  cr_expect_leq(big.cap, total + k2);
  cr_assert_eq(shardd__frame_reader_next(&big, &p, &n), SHARDD_OK);
  cr_assert_eq(n, len);
  cr_assert_eq(shardd__frame_reader_next(&big, &p, &n), SHARDD_OK);
  cr_assert(n == 2 && memcmp(p, "ok", 2) == 0);
  shardd__frame_reader_free(&big);
  free(two);
  free(f);
}

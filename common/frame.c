/* frame.c — length-prefixed framing and the client's blocking frame I/O. */
#include "frame.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* A buffer up to this size is kept for the next frames, so a session
 * exchanging small frames costs no malloc a frame; a bigger one (a 64 KiB
 * read, a big frame) is given back once drained, or its few pending bytes
 * moved to one this size: every idle session keeping its last 64-128 KiB
 * read cost 20-45 MiB for one uid's 256 connections, uncounted. */
#define TRIM_KEEP ((size_t)8 << 10)

void shardd__frame_reader_init(shardd__frame_reader *r, size_t max_frame) {
  memset(r, 0, sizeof *r);
  r->max_frame = max_frame;
}

void shardd__frame_reader_free(shardd__frame_reader *r) {
  free(r->buf);
  memset(r, 0, sizeof *r);
}

/* Drops the frame handed out last and slides what remains to the front, so
 * the buffer never grows past one frame plus one read. */
static void frame_reader_compact(shardd__frame_reader *r) {
  r->off += r->taken;
  r->taken = 0;
  if (r->off == 0)
    return;
  memmove(r->buf, r->buf + r->off, r->len - r->off);
  r->len -= r->off;
  r->off = 0;
}

/* Where the frame at the front of r (after compaction) ends once whole, when
 * its header is among the len held bytes and the n arriving at data; 0 when
 * not, or when it announces more than max_frame (next() refuses it). */
static size_t front_frame_end(const shardd__frame_reader *r, const void *data,
                              size_t n) {
  if (r->len + n < SHARDD_FRAME_HEADER)
    return 0;
  uint8_t h[SHARDD_FRAME_HEADER];
  size_t have = r->len < SHARDD_FRAME_HEADER ? r->len : SHARDD_FRAME_HEADER;
  if (have > 0)
    memcpy(h, r->buf, have);
  memcpy(h + have, data, SHARDD_FRAME_HEADER - have);
  uint32_t len = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 |
                 (uint32_t)h[3] << 24;
  return len > r->max_frame ? 0 : SHARDD_FRAME_HEADER + (size_t)len;
}

shardd_err shardd__frame_reader_feed(shardd__frame_reader *r, const void *data,
                                     size_t n) {
  frame_reader_compact(r);
  if (n > SIZE_MAX - r->len)
    return SHARDD_E_NO_MEMORY;
  if (r->len + n > r->cap) {
    size_t cap = r->cap ? r->cap : 4096;
    while (cap < r->len + n)
      cap *= 2;
    /* Doubling past a big frame only reserved memory it would not use: a
     * 1 MiB frame held a 2 MiB buffer. So a big frame in front gets what
     * it needs (or what this read brings, when that is more), and only the
     * small ones keep the doubling that saves a realloc per frame. */
    size_t end = front_frame_end(r, data, n);
    if (end > TRIM_KEEP) {
      if (end < r->len + n)
        end = r->len + n;
      if (end < cap)
        cap = end;
    }
    uint8_t *p = realloc(r->buf, cap);
    if (p == NULL)
      return SHARDD_E_NO_MEMORY;
    r->buf = p;
    r->cap = cap;
  }
  memcpy(r->buf + r->len, data, n);
  r->len += n;
  return SHARDD_OK;
}

static uint32_t get_header(const uint8_t *h) {
  return (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 |
         (uint32_t)h[3] << 24;
}

shardd_err shardd__frame_reader_next(shardd__frame_reader *r,
                                     const uint8_t **payload, size_t *len) {
  *payload = NULL;
  *len = 0;
  r->off += r->taken;
  r->taken = 0;
  size_t avail = r->len - r->off;
  if (avail < SHARDD_FRAME_HEADER)
    return SHARDD_OK;
  const uint8_t *h = r->buf + r->off;
  uint32_t n = get_header(h);
  if (n > r->max_frame)
    return SHARDD_E_FRAME_TOO_LARGE;
  if (avail - SHARDD_FRAME_HEADER < n)
    return SHARDD_OK;
  *payload = h + SHARDD_FRAME_HEADER;
  *len = n;
  r->taken = SHARDD_FRAME_HEADER + n;
  return SHARDD_OK;
}

size_t shardd__frame_reader_pending(const shardd__frame_reader *r) {
  return r->len - r->off - r->taken;
}

size_t shardd__frame_reader_need(const shardd__frame_reader *r) {
  size_t start = r->off + r->taken, pos = start;
  while (r->len - pos >= SHARDD_FRAME_HEADER) {
    uint32_t n = get_header(r->buf + pos);
    if (n > r->max_frame)
      return r->len - start;
    if (r->len - pos - SHARDD_FRAME_HEADER < n)
      return pos - start + SHARDD_FRAME_HEADER + n;
    pos += SHARDD_FRAME_HEADER + n;
  }
  return r->len - start;
}

void shardd__frame_reader_trim(shardd__frame_reader *r) {
  if (r->cap <= TRIM_KEEP)
    return;
  size_t pending = shardd__frame_reader_pending(r);
  if (pending == 0) {
    free(r->buf);
    r->buf = NULL;
    r->len = r->off = r->taken = r->cap = 0;
    return;
  }
  if (pending > TRIM_KEEP / 2)
    return; /* most of a read or of a frame: its next read grows it anyway */
  frame_reader_compact(r);
  uint8_t *p = realloc(r->buf, TRIM_KEEP);
  if (p == NULL)
    return; /* keeps the bigger one, still valid */
  r->buf = p;
  r->cap = TRIM_KEEP;
}

void shardd__frame_put_header(uint8_t out[SHARDD_FRAME_HEADER], uint32_t len) {
  out[0] = (uint8_t)len;
  out[1] = (uint8_t)(len >> 8);
  out[2] = (uint8_t)(len >> 16);
  out[3] = (uint8_t)(len >> 24);
}

/* Sends header and payload with one sendmsg (one wakeup of the peer per
 * frame), continuing after short writes. */
static shardd_err send_frame(int fd, const uint8_t *hdr, const void *payload,
                             size_t n, int timeout_ms, char *err,
                             size_t errlen) {
  struct iovec iov[2] = {{(void *)hdr, SHARDD_FRAME_HEADER},
                         {(void *)payload, n}};
  struct iovec *v = iov;
  int cnt = n > 0 ? 2 : 1;
  while (cnt > 0) {
    struct msghdr msg = {0};
    msg.msg_iov = v;
    msg.msg_iovlen = (size_t)cnt;
    ssize_t w = sendmsg(fd, &msg,
                        MSG_NOSIGNAL | (timeout_ms >= 0 ? MSG_DONTWAIT : 0));
    if (w < 0) {
      if (errno == EINTR)
        continue;
      if (timeout_ms >= 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        shardd_err rc = shardd__frame_wait(fd, POLLOUT, timeout_ms);
        if (rc == SHARDD_OK)
          continue;
        if (err)
          snprintf(err, errlen, "send: the peer read nothing for %d ms",
                   timeout_ms);
        return rc;
      }
      if (err)
        snprintf(err, errlen, "send: %s", strerror(errno));
      return errno == EPIPE || errno == ECONNRESET ? SHARDD_E_CLOSED
                                                   : SHARDD_E_IO;
    }
    size_t left = (size_t)w;
    while (cnt > 0 && left >= v->iov_len) {
      left -= v->iov_len;
      v++;
      cnt--;
    }
    if (cnt > 0) {
      v->iov_base = (char *)v->iov_base + left;
      v->iov_len -= left;
    }
  }
  return SHARDD_OK;
}

shardd_err shardd__frame_wait(int fd, short events, int timeout_ms) {
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    struct pollfd p = {.fd = fd, .events = events};
    int left = timeout_ms;
    if (timeout_ms > 0) { /* an EINTR does not restart the wait's clock */
      struct timespec t;
      clock_gettime(CLOCK_MONOTONIC, &t);
      long spent = (long)(t.tv_sec - t0.tv_sec) * 1000 +
                   (t.tv_nsec - t0.tv_nsec) / 1000000;
      left = spent >= timeout_ms ? 0 : timeout_ms - (int)spent;
    }
    int n = poll(&p, 1, left);
    if (n > 0)
      return SHARDD_OK; /* ready, or an error/hangup the next call reports */
    if (n == 0)
      return SHARDD_E_TIMEOUT;
    if (errno != EINTR)
      return SHARDD_OK; /* let the read or write itself report it */
  }
}

shardd_err shardd__frame_send(int fd, const void *payload, size_t len,
                              char *err, size_t errlen) {
  return shardd__frame_send_within(fd, payload, len, -1, err, errlen);
}

shardd_err shardd__frame_send_within(int fd, const void *payload, size_t len,
                                     int timeout_ms, char *err, size_t errlen) {
  if (len > UINT32_MAX) {
    if (err)
      snprintf(err, errlen, "frame of %zu bytes cannot be encoded", len);
    return SHARDD_E_FRAME_TOO_LARGE;
  }
  uint8_t hdr[SHARDD_FRAME_HEADER];
  shardd__frame_put_header(hdr, (uint32_t)len);
  return send_frame(fd, hdr, payload, len, timeout_ms, err, errlen);
}

static void take_fds(struct msghdr *msg, int *fds, int maxfds, int *nfds) {
  for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c != NULL;
       c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
      continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char *data = CMSG_DATA(c);
    for (size_t i = 0; i < n; i++) {
      int fd;
      memcpy(&fd, data + i * sizeof(int), sizeof fd);
      if (fds != NULL && *nfds < maxfds)
        fds[(*nfds)++] = fd;
      else
        close(fd);
    }
  }
}

shardd_err shardd__frame_recv(int fd, shardd__frame_reader *r,
                              const uint8_t **payload, size_t *len, int *fds,
                              int maxfds, int *nfds, char *err, size_t errlen) {
  return shardd__frame_recv_within(fd, r, payload, len, fds, maxfds, nfds, -1,
                                   err, errlen);
}

shardd_err shardd__frame_recv_within(int fd, shardd__frame_reader *r,
                                     const uint8_t **payload, size_t *len,
                                     int *fds, int maxfds, int *nfds,
                                     int timeout_ms, char *err, size_t errlen) {
  *nfds = 0;
  for (;;) {
    shardd_err rc = shardd__frame_reader_next(r, payload, len);
    if (rc != SHARDD_OK) {
      if (err)
        snprintf(err, errlen, "peer announced a frame over %zu bytes",
                 r->max_frame);
      return rc;
    }
    if (*payload != NULL)
      return SHARDD_OK;

    uint8_t buf[65536];
    union {
      struct cmsghdr align;
      char space[CMSG_SPACE(sizeof(int) * SHARDD_FRAME_FDS_PER_READ)];
    } ctl;
    /* Read no further than the end of the frame being assembled. The
     * kernel hands SCM_RIGHTS descriptors to the read that reaches the
     * first byte they were sent with, so a read that ran into the next
     * frame took that frame's descriptors and counted them as this one's
     * (tests/unit/test_frame.c: fd_belongs_to_its_own_frame). Costs one more
     * read per frame (header, then body). */
    size_t want = sizeof buf;
    size_t avail = r->len - r->off;
    if (avail < SHARDD_FRAME_HEADER) {
      want = SHARDD_FRAME_HEADER - avail;
    } else {
      const uint8_t *h = r->buf + r->off;
      size_t n = (size_t)((uint32_t)h[0] | (uint32_t)h[1] << 8 |
                          (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24);
      /* reader_next returned "need more", so n <= max_frame and the
       * frame is not yet whole: avail < header + n */
      if (SHARDD_FRAME_HEADER + n - avail < want)
        want = SHARDD_FRAME_HEADER + n - avail;
    }
    struct iovec iov = {buf, want};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.space;
    msg.msg_controllen = sizeof ctl.space;
    /* with a timeout: read what is there, and wait (poll) only when
     * nothing is, so a reply already in the socket costs no extra call */
    ssize_t got = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC |
                                        (timeout_ms >= 0 ? MSG_DONTWAIT : 0));
    if (got < 0) {
      if (errno == EINTR)
        continue;
      if (timeout_ms >= 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (shardd__frame_wait(fd, POLLIN, timeout_ms) == SHARDD_OK)
          continue;
        if (err)
          snprintf(err, errlen, "recv: nothing arrived for %d ms", timeout_ms);
        return SHARDD_E_TIMEOUT;
      }
      if (err)
        snprintf(err, errlen, "recv: %s", strerror(errno));
      return errno == ECONNRESET ? SHARDD_E_CLOSED : SHARDD_E_IO;
    }
    take_fds(&msg, fds, maxfds, nfds);
    if (got == 0) {
      if (err)
        snprintf(err, errlen, "the daemon closed the connection");
      return SHARDD_E_CLOSED;
    }
    rc = shardd__frame_reader_feed(r, buf, (size_t)got);
    if (rc != SHARDD_OK) {
      if (err)
        snprintf(err, errlen, "out of memory buffering a frame");
      return rc;
    }
  }
}

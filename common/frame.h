/* frame.h — length-prefixed framing shared by the daemon and libshardd:
 * a 4-byte little-endian payload length, then the payload (one packed
 * protobuf message). Also the blocking send/receive the client uses, with
 * SCM_RIGHTS descriptors collected on receive.
 *
 * The reader owns its buffer; a payload it returns is borrowed and valid
 * until the next feed or next call on the same reader. */
#ifndef SHARDD_FRAME_H
#define SHARDD_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "shardd.h"

#define SHARDD_FRAME_HEADER 4u

/* The descriptors one read takes (its control buffer's room): a writer
 * sends at most this many with one write, or a reader of this size (every
 * libshardd so far) would find the rest cut off (MSG_CTRUNC) and closed. */
#define SHARDD_FRAME_FDS_PER_READ 16

typedef struct {
  /* private */
  uint8_t *buf;
  size_t len;  /* bytes held */
  size_t off;  /* bytes already consumed by next() */
  size_t cap;
  size_t max_frame;
  size_t taken; /* size of the frame handed out last, dropped on next use */
} shardd__frame_reader;

void shardd__frame_reader_init(shardd__frame_reader *r, size_t max_frame);
void shardd__frame_reader_free(shardd__frame_reader *r);

/* Appends n received bytes. SHARDD_E_NO_MEMORY if they cannot be held. */
shardd_err shardd__frame_reader_feed(shardd__frame_reader *r, const void *data,
                                     size_t n);

/* Hands out the next complete frame: SHARDD_OK with *payload set, or
 * SHARDD_OK with *payload NULL when more bytes are needed.
 * SHARDD_E_FRAME_TOO_LARGE when the next header announces more than
 * max_frame; the stream cannot be resynchronised after that. */
shardd_err shardd__frame_reader_next(shardd__frame_reader *r,
                                     const uint8_t **payload, size_t *len);

/* Bytes received but not yet handed out as a frame. */
size_t shardd__frame_reader_pending(const shardd__frame_reader *r);

/* Bytes r will hold once the frame it is receiving is whole: the whole
 * frames not yet handed out, plus the partial one's header and announced
 * payload (with less than a header of it, the bytes there are); 0 when
 * nothing is pending. The daemon charges this to its partial-frame
 * budget before it reads more of the frame. A header over max_frame
 * counts as the bytes held (next() refuses it). */
size_t shardd__frame_reader_need(const shardd__frame_reader *r);

/* Gives back the buffer's memory beyond a small one (8 KiB): all of it
 * when nothing is pending, else a few pending bytes are moved to a small
 * buffer. One 16 MiB frame left every session holding 16 MiB (the buffer
 * only grew) after it was handled, and a 64 KiB read 64-128 KiB. Call only
 * when no payload handed out is in use. */
void shardd__frame_reader_trim(shardd__frame_reader *r);

void shardd__frame_put_header(uint8_t out[SHARDD_FRAME_HEADER], uint32_t len);

/* Blocking write of one frame to fd (EINTR and short writes handled). */
shardd_err shardd__frame_send(int fd, const void *payload, size_t len,
                              char *err, size_t errlen);

/* Blocking read until r yields one frame. Descriptors that arrive on the way
 * are stored in fds (at most maxfds, extras closed) and counted in *nfds;
 * the caller owns them. SHARDD_E_CLOSED on orderly EOF. */
shardd_err shardd__frame_recv(int fd, shardd__frame_reader *r,
                              const uint8_t **payload, size_t *len, int *fds,
                              int maxfds, int *nfds, char *err, size_t errlen);

/* As above, but each wait for the socket gives up after timeout_ms without
 * progress (< 0: never): SHARDD_E_TIMEOUT, the reason in err. Progress
 * restarts the clock, so this bounds silence, not the whole transfer. A
 * frame partly received stays in r for the next call (descriptors that
 * came with it are returned in fds like any error's, the caller closes
 * them); a frame partly sent cannot be resumed, so after a send's timeout
 * the stream is unusable (the caller closes it). */
shardd_err shardd__frame_send_within(int fd, const void *payload, size_t len,
                                     int timeout_ms, char *err, size_t errlen);
shardd_err shardd__frame_recv_within(int fd, shardd__frame_reader *r,
                                     const uint8_t **payload, size_t *len,
                                     int *fds, int maxfds, int *nfds,
                                     int timeout_ms, char *err, size_t errlen);

/* Waits up to timeout_ms (< 0: forever) for fd to be ready for events
 * (POLLIN, POLLOUT): SHARDD_OK when ready or in error (the next read or
 * write reports it), SHARDD_E_TIMEOUT when not. */
shardd_err shardd__frame_wait(int fd, short events, int timeout_ms);

#endif /* SHARDD_FRAME_H */

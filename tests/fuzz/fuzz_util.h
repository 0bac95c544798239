/* fuzz_util.h — what the libFuzzer targets over the daemon share: their
 * scratch directory's removal and the reading of the daemon's replies. Each
 * target is one program that includes this once. */
#ifndef SHARDD_FUZZ_UTIL_H
#define SHARDD_FUZZ_UTIL_H

#include <ftw.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

/* The target's scratch directory (its init makes it), removed at exit. */
static char root[64];

static inline int fuzz_rm_entry(const char *path, const struct stat *st,
                                int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

/* For atexit: the replies' checkpoints and manifests go with the run. */
static inline void fuzz_rm_root(void) {
  nftw(root, fuzz_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* One non-blocking read of what the daemon sent on fd into buf, closing
 * every descriptor passed with it (a fuzz run would run out of them):
 * recvmsg's count, <= 0 when nothing more is there. */
static inline ssize_t fuzz_recv_drop(int fd, char *buf, size_t cap) {
  union {
    struct cmsghdr align;
    char space[CMSG_SPACE(sizeof(int) * 8)];
  } ctl;
  struct iovec iov = {buf, cap};
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctl.space;
  msg.msg_controllen = sizeof ctl.space;
  ssize_t n = recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); n >= 0 && c;
       c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; i++) {
        int pfd;
        memcpy(&pfd, CMSG_DATA(c) + i * sizeof(int), sizeof pfd);
        close(pfd);
      }
    }
  }
  return n;
}

#endif

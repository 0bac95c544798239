/* sdnotify.h — the daemon's side of the two systemd protocols it speaks,
 * implemented directly (no libsystemd): readiness/status notification to
 * $NOTIFY_SOCKET and socket activation through $LISTEN_PID/$LISTEN_FDS.
 * Both are no-ops outside systemd, so the daemon runs the same by hand. */
#ifndef SHARDD_SDNOTIFY_H
#define SHARDD_SDNOTIFY_H

#include <stddef.h>

#include "shardd.h"

/* The first fd passed by socket activation. */
#define SHARDD_SD_LISTEN_FDS_START 3

/* Sends state (e.g. "READY=1\nSTATUS=serving") to $NOTIFY_SOCKET as one
 * datagram (AF_UNIX SOCK_DGRAM; a leading '@' means the abstract namespace).
 * Returns SHARDD_OK and does nothing when NOTIFY_SOCKET is unset or empty;
 * SHARDD_E_INVAL when state is NULL or the variable is not an absolute path
 * or '@' name that fits sun_path; SHARDD_E_BUSY, the message dropped, when
 * the manager's queue stays full: a message waits 1 s at most for room
 * (the caller is the loop thread), and none waits while the manager is
 * stalled (a wait ran out and no message has been sent since);
 * SHARDD_E_IO when sending fails otherwise. On error,
 * when err is not NULL, err holds the reason (naming the socket and the
 * strerror). Does not change the environment. */
shardd_err shardd__sd_notify(const char *state, char *err, size_t errlen);

/* Socket activation: returns the number of fds passed (they start at
 * SHARDD_SD_LISTEN_FDS_START) when $LISTEN_PID equals getpid() and
 * $LISTEN_FDS is a valid count, else 0 (unset, or meant for another
 * process). Sets FD_CLOEXEC on the passed fds, so children the daemon starts
 * do not inherit the listener. A malformed LISTEN_PID or LISTEN_FDS, or a
 * passed fd that is not open, gives -1. When unset_env, unsets LISTEN_PID,
 * LISTEN_FDS and LISTEN_FDNAMES whatever the result, so children do not
 * mistake them for their own. */
int shardd__sd_listen_fds(int unset_env);

/* As shardd__sd_notify, with fd passed along (SCM_RIGHTS) in the same
 * datagram: "FDSTORE=1\nFDNAME=NAME" hands the service manager a
 * duplicate of fd to keep for the next start (its file descriptor store).
 * fd < 0 sends no descriptor. SHARDD_OK and nothing sent without
 * $NOTIFY_SOCKET. fd stays the caller's. */
shardd_err shardd__sd_notify_fd(const char *state, int fd, char *err,
                                size_t errlen);

/* Whether name may be an FDNAME: 1..255 printable ASCII bytes without
 * ':' (LISTEN_FDNAMES' separator), as systemd's fdname_is_valid. */
int shardd__sd_fdname_valid(const char *name);

/* As shardd__sd_listen_fds, and *names (when not NULL) a malloc'd array
 * of the count's malloc'd names from $LISTEN_FDNAMES (missing ones
 * "unknown", as sd_listen_fds_with_names gives them), read before the
 * variables are unset; the caller frees each and the array. *names is
 * NULL when the result is <= 0 or out of memory. */
int shardd__sd_listen_fds_names(int unset_env, char ***names);

/* 1 when fd is a listening AF_UNIX SOCK_STREAM socket, else 0 (including
 * fd < 0 and fds that are not sockets); validates an activated fd before the
 * daemon serves it. */
int shardd__sd_is_unix_listener(int fd);

#endif

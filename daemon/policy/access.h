/* access.h — who a peer is and what it may do: join a job, see one,
 * checkpoint one, name a checkpoint directory. Every access decision of
 * the request path is here, so there is one place to read them. (Restore
 * checks the recorded owner and the files' owners in restore.c, as only it
 * reads the manifest.)
 *
 * Ownership: plain values; nothing is kept. */
#ifndef SHARDD_ACCESS_H
#define SHARDD_ACCESS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "registry.h"

typedef struct {
  pid_t pid;
  uid_t uid;
  gid_t gid;
  int admin; /* root or a member of --admin-group: sees every job */
} shardd__peer;

/* The peer of a connected Unix socket (SO_PEERCRED); admin_gid < 0: no
 * admin group. A peer whose credentials cannot be read is uid 0 pid 0,
 * as the kernel reports for itself. */
void shardd__peer_of_fd(int fd, int64_t admin_gid, shardd__peer *out);

/* The job p names by the string name. Job names are per uid, so a name is
 * first p's own job of that name; root and the admin group (who see every
 * job) may also name uid U's job NAME as "U/NAME" (their own job of that
 * literal name, if they have one, comes first). NULL when there is none
 * the peer can name: another user's job is then indistinguishable from no
 * job. What p may do with the job found is still the checks below. */
shardd__job *shardd__access_find_job(shardd__registry *reg,
                                     const shardd__peer *p, const char *name);

/* Whether p may see job: its owner's uid, root, or the admin group. */
int shardd__access_may_see(const shardd__peer *p, const shardd__job *job);
/* A job is its creator's: another user may not join it (root may, by
 * naming it "UID/NAME"; the admin group only looks). */
shardd_err shardd__access_join(const shardd__peer *p, const shardd__job *job,
                               char *err, size_t errlen);
/* Only the job's owner or root may checkpoint it. */
shardd_err shardd__access_checkpoint(const shardd__peer *p,
                                     const shardd__job *job, char *err,
                                     size_t errlen);
/* Only the job's owner or root may release it (shardctl release). */
shardd_err shardd__access_release(const shardd__peer *p, const shardd__job *job,
                                  char *err, size_t errlen);
/* A client names the directory, the daemon writes or reads it: only
 * absolute paths without "." or ".." parts; when root (--checkpoint-root)
 * is not NULL, below root for uid 0 and below root/UID, that user's own
 * directory (see shardd__checkpoint_user_dir), for any other uid.
 * SHARDD_E_PERMISSION with the reason otherwise; SHARDD_E_RANGE for a
 * path of PATH_MAX bytes or more. */
shardd_err shardd__access_checkpoint_dir(const char *root, uint32_t uid,
                                         const char *dir, char *err,
                                         size_t errlen);

/* The length of root without its trailing slashes ("/" stays 1): how
 * --checkpoint-root is compared with and joined to other paths. */
size_t shardd__access_root_len(const char *root);

#endif /* SHARDD_ACCESS_H */

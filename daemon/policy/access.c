/* access.c — peers and access decisions (see access.h). */
#include "access.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

/* Whether the peer process is in gid, as primary or supplementary group
 * (the latter read from /proc, as SO_PEERCRED carries only the primary). */
static int peer_in_group(const struct ucred *cred, int64_t gid) {
  if (gid < 0)
    return 0;
  if ((int64_t)cred->gid == gid)
    return 1;
  char path[64], line[4096];
  snprintf(path, sizeof path, "/proc/%d/status", (int)cred->pid);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return 0;
  int found = 0;
  while (!found && fgets(line, sizeof line, f)) {
    if (strncmp(line, "Groups:", 7) != 0)
      continue;
    char *save;
    for (char *t = strtok_r(line + 7, " \t\n", &save); t;
         t = strtok_r(NULL, " \t\n", &save))
      if (strtoll(t, NULL, 10) == gid)
        found = 1;
  }
  fclose(f);
  return found;
}

void shardd__peer_of_fd(int fd, int64_t admin_gid, shardd__peer *out) {
  struct ucred cred;
  memset(&cred, 0, sizeof cred);
  socklen_t len = sizeof cred;
  if (fd >= 0)
    getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len);
  out->pid = cred.pid;
  out->uid = cred.uid;
  out->gid = cred.gid;
  out->admin = cred.uid == 0 || peer_in_group(&cred, admin_gid);
}

shardd__job *shardd__access_find_job(shardd__registry *reg,
                                     const shardd__peer *p, const char *name) {
  if (name == NULL || name[0] == '\0')
    return NULL;
  shardd__job *own = shardd__job_find(reg, (uint32_t)p->uid, name);
  if (own || !p->admin)
    return own;
  /* "UID/NAME": decimal digits, then the first '/' */
  const char *slash = strchr(name, '/');
  if (slash == NULL || slash == name || slash - name > 10 || slash[1] == '\0')
    return NULL;
  for (const char *q = name; q < slash; q++)
    if (*q < '0' || *q > '9')
      return NULL;
  errno = 0;
  char *end;
  unsigned long long uid = strtoull(name, &end, 10);
  if (errno || end != slash || uid > UINT32_MAX)
    return NULL;
  return shardd__job_find(reg, (uint32_t)uid, slash + 1);
}

int shardd__access_may_see(const shardd__peer *p, const shardd__job *job) {
  return p->admin || job->uid == p->uid;
}

shardd_err shardd__access_join(const shardd__peer *p, const shardd__job *job,
                               char *err, size_t errlen) {
  if (job->uid == p->uid || p->uid == 0)
    return SHARDD_OK;
  /* which uid owns it is not the asker's to learn */
  snprintf(err, errlen, "job \"%s\" belongs to another user; uid %d may not "
           "join it", job->name, (int)p->uid);
  return SHARDD_E_PERMISSION;
}

shardd_err shardd__access_checkpoint(const shardd__peer *p,
                                     const shardd__job *job, char *err,
                                     size_t errlen) {
  if (job->uid == p->uid || p->uid == 0)
    return SHARDD_OK;
  snprintf(err, errlen, "job \"%s\" belongs to another user; only it or root "
           "may checkpoint it", job->name);
  return SHARDD_E_PERMISSION;
}

shardd_err shardd__access_release(const shardd__peer *p, const shardd__job *job,
                                  char *err, size_t errlen) {
  if (job->uid == p->uid || p->uid == 0)
    return SHARDD_OK;
  snprintf(err, errlen, "job \"%s\" belongs to another user; only it or root "
           "may release it", job->name);
  return SHARDD_E_PERMISSION;
}

shardd_err shardd__access_checkpoint_dir(const char *root, uint32_t uid,
                                         const char *dir, char *err,
                                         size_t errlen) {
  if (dir == NULL || dir[0] != '/') {
    snprintf(err, errlen, "checkpoint directory \"%s\" is not an absolute path",
             dir ? dir : "");
    return SHARDD_E_PERMISSION;
  }
  /* bounded before anything keeps a copy (a wait holds it for minutes) */
  if (strnlen(dir, PATH_MAX) >= PATH_MAX) {
    snprintf(err, errlen, "checkpoint directory \"%.64s...\" is %zu bytes, "
             "longer than PATH_MAX (%d) allows", dir, strlen(dir), PATH_MAX - 1);
    return SHARDD_E_RANGE;
  }
  for (const char *p = dir; (p = strchr(p, '/')) != NULL; p++) {
    if ((p[1] == '.' && (p[2] == '/' || p[2] == '\0')) ||
        (p[1] == '.' && p[2] == '.' && (p[3] == '/' || p[3] == '\0'))) {
      snprintf(err, errlen, "checkpoint directory %s has a . or .. part", dir);
      return SHARDD_E_PERMISSION;
    }
  }
  size_t n = root ? shardd__access_root_len(root) : 0;
  if (root && !(strncmp(dir, root, n) == 0 && dir[n] == '/' && dir[n + 1])) {
    snprintf(err, errlen, "checkpoint directory %s is not below %.*s "
             "(--checkpoint-root)", dir, (int)n, root);
    return SHARDD_E_PERMISSION;
  }
  if (root && uid != 0) {
    /* each user's checkpoints live in its own root/UID */
    char own[32];
    int k = snprintf(own, sizeof own, "%" PRIu32 "/", uid);
    const char *rest = dir + n + 1; /* dir[n] is the '/' checked above */
    if (strncmp(rest, own, (size_t)k) != 0 || rest[k] == '\0') {
      snprintf(err, errlen, "checkpoint directory %s is not below %.*s/%" PRIu32
               "/, uid %" PRIu32 "'s own directory under --checkpoint-root",
               dir, (int)n, root, uid, uid);
      return SHARDD_E_PERMISSION;
    }
  }
  return SHARDD_OK;
}

size_t shardd__access_root_len(const char *root) {
  size_t n = strlen(root);
  while (n > 1 && root[n - 1] == '/')
    n--;
  return n;
}

/* fabric_gloo.cc — the fabric (fabric.h) on Gloo: TCP transport, one
 * gloo::rendezvous::Context per job with one member per node, connected
 * through a key-value store of files in the job's rendezvous directory
 * (dir_store: Gloo's FileStore, opened safely; see "rendezvous files").
 * Every entry point catches everything (Gloo throws on IO errors, timeouts
 * and failed checks; the standard library throws bad_alloc) and turns it
 * into a shardd_err with its message; nothing C++ crosses the C interface.
 *
 * Rendezvous. A second incarnation of a job in the same directory (the
 * job released and made again while the daemons run, or a daemon
 * restarted) would meet the key files of the first one and read addresses
 * that are gone (Gloo's own FileStore refused to set a key that exists,
 * and failed). So the nodes first agree on a fresh namespace with files of
 * their own, which they replace rather than add to: node r writes PREFIX.node<r> with a
 * random nonce, reads every other node's, and writes PREFIX.node<r>.seen
 * with the nonces it read (its own current one in its place); when every
 * node's .seen equals its own, each node has read every other node's
 * current nonce (its own is new, so no older file can hold it), and the
 * hash of that list names the key namespace of this incarnation.
 * A node whose files are missing or never confirm is named in the timeout
 * message. This node's key files are removed when the fabric is
 * destroyed (by then every peer has read them).
 *
 * Reduce-scatter. This Gloo snapshot (Debian 0.0~git20220518) has no
 * tag-based reduce_scatter (its ReduceScatterHalvingDoubling takes context
 * slots from nextSlot(), which is not thread-safe, and counts elements in
 * an int), so it is a ring over tagged unbound-buffer sends and receives:
 * in step s = 0 .. nodes-2 node r sends its partial sum of part
 * (r - s - 1) mod nodes to node r+1 and adds the same step's part from
 * node r-1 into its own copy of part (r - s - 2) mod nodes, in segments
 * received into two alternating scratch areas. After nodes-1 steps part r
 * holds the sum over nodes, added in ring order, which is fixed for a
 * fixed layout: (nodes-1)/nodes of the buffer crosses the wire per node,
 * half of what an allreduce would move.
 *
 * Allgather. Gloo's own collectives (gloo::allgather and the rest) make
 * their unbound buffers inside the call, where nothing can abort their
 * waits, and ignore a wait that returns aborted. So every operation here is
 * made of tagged unbound-buffer sends and receives of this file: the
 * allgather sends this node's part to every other node and receives each
 * of theirs in place ((nodes-1) parts each way, as Gloo's ring moves), and
 * the f64 allreduce and the barrier are allgathers.
 *
 * Abort. Every unbound buffer an operation waits on is listed in the
 * fabric while it lives; shardd__fabric_abort marks the fabric aborted and
 * calls abortWaitRecv/abortWaitSend on each listed one. Gloo keeps that
 * mark until a wait consumes it (the wait returns false, at once), so a
 * thread about to wait when the abort comes still ends; a buffer made after
 * the abort is refused when it is listed. The sends and receives still
 * posted stay with the pairs, which hold the buffers weakly (Gloo's
 * WeakNonOwningPtr): the buffer's end drops them. */
#include "fabric.h"
#include "hash.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

namespace {

/* Gloo's collectives use slot prefixes 0x01..0x08; ours are far from them. */
constexpr uint8_t kReduceScatterSlotPrefix = 0x53;
constexpr uint8_t kAllgatherSlotPrefix = 0x54;
/* Segments of the reduce-scatter: two of these are the only scratch. */
constexpr size_t kSegmentBytes = size_t(4) << 20;

/* Longer waits gain nothing and would overflow Gloo's deadline arithmetic
 * (steady_clock nanoseconds). */
constexpr double kMaxTimeoutS = 1e7;

} // namespace

struct shardd__fabric {
  std::shared_ptr<gloo::transport::Device> dev;
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  std::chrono::milliseconds timeout;
  uint32_t nodes, node_rank;
  int dir = -1;                  /* the rendezvous directory (open_rendezvous) */
  std::vector<std::string> keys; /* this node's key files in it */
  /* the abort (see the top of the file): mu guards why and live */
  std::mutex mu;
  std::atomic<bool> aborted{false};
  std::string why;
  std::vector<gloo::transport::UnboundBuffer *> live;
};

/* Thrown where a wait ended because of shardd__fabric_abort. */
struct aborted_error : std::exception {
  const char *what() const noexcept override { return "aborted"; }
};

/* Lists buf in f->live for its lifetime, so an abort reaches its waits;
 * declared after the buffer's unique_ptr, so it lets go of it first. */
class watched {
public:
  watched(shardd__fabric *f, gloo::transport::UnboundBuffer *buf) : f_(f), buf_(buf) {
    std::lock_guard<std::mutex> g(f_->mu);
    if (f_->aborted)
      throw aborted_error();
    f_->live.push_back(buf_);
  }
  ~watched() {
    std::lock_guard<std::mutex> g(f_->mu);
    auto it = std::find(f_->live.begin(), f_->live.end(), buf_);
    if (it != f_->live.end())
      f_->live.erase(it);
  }
  watched(const watched &) = delete;
  watched &operator=(const watched &) = delete;

private:
  shardd__fabric *f_;
  gloo::transport::UnboundBuffer *buf_;
};

/* Waits of an operation of f: false from Gloo is the abort. */
static void wait_recv(shardd__fabric *f, gloo::transport::UnboundBuffer *b) {
  if (f->aborted || !b->waitRecv(f->timeout))
    throw aborted_error();
}

static void wait_send(shardd__fabric *f, gloo::transport::UnboundBuffer *b) {
  if (f->aborted || !b->waitSend(f->timeout))
    throw aborted_error();
}

static void put(char *err, size_t errlen, const char *what, const char *msg) {
  if (err && errlen)
    snprintf(err, errlen, "%s: %s", what, msg);
}

/* Gloo's messages start with the source location ("[./gloo/...cc:598] "
 * or "[enforce fail at ./gloo/...cc:77] "); the reader wants the rest. */
static const char *gloo_message(const char *m) {
  if (m[0] != '[')
    return m;
  const char *end = strstr(m, "] ");
  if (end == nullptr || end - m > 160)
    return m;
  const char *src = strstr(m, ".cc:");
  if (src == nullptr || src > end)
    src = strstr(m, ".h:");
  return src && src < end ? end + 2 : m;
}

/* Runs body; an exception becomes err and code. */
template <typename F>
static shardd_err guarded(char *err, size_t errlen, const char *what,
                          shardd_err code, F body) {
  try {
    return body();
  } catch (const std::bad_alloc &) {
    put(err, errlen, what, "out of memory");
    return SHARDD_E_NO_MEMORY;
  } catch (const std::exception &e) {
    put(err, errlen, what, gloo_message(e.what()));
    return code;
  } catch (...) {
    put(err, errlen, what, "unknown exception");
    return code;
  }
}

/* An operation of f: as guarded, and once f is aborted its failure is
 * the abort's (a peer that closed meanwhile is not the reason). */
template <typename F>
static shardd_err fabric_op(shardd__fabric *f, char *err, size_t errlen,
                            const char *what, F body) {
  shardd_err rc = guarded(err, errlen, what, SHARDD_E_PEER_LOST, body);
  if (rc != SHARDD_OK && f->aborted) {
    std::string why;
    try {
      std::lock_guard<std::mutex> g(f->mu);
      why = f->why;
    } catch (...) {
    }
    put(err, errlen, what, why.empty() ? "aborted" : why.c_str());
    rc = SHARDD_E_SHUTDOWN;
  }
  return rc;
}

extern "C" const char *shardd__fabric_engine(void) { return "gloo"; }

/* ---- rendezvous files ---------------------------------------------------- */

static uint64_t fnv64(const std::string &s) {
  return shardd__fnv1a(SHARDD__FNV1A_BASIS, s.data(), s.size());
}

static std::string hex64(uint64_t v) {
  char b[17];
  snprintf(b, sizeof b, "%016llx", (unsigned long long)v);
  return b;
}

static uint64_t fresh_nonce() {
  uint64_t v = 0;
  if (getrandom(&v, sizeof v, 0) == (ssize_t)sizeof v && v != 0)
    return v;
  /* no entropy source: time and pid still differ between incarnations */
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  v = fnv64(std::to_string(ts.tv_sec) + "." + std::to_string(ts.tv_nsec) + "." +
            std::to_string(getpid()));
  return v ? v : 1;
}

/* The rendezvous directory. Every node's daemon, usually root, writes and
 * reads files in it, so a user who may write into it could plant a symlink
 * where the daemon writes (a root-owned file truncated and overwritten), a
 * directory or FIFO where it reads (the fabric blocked), or a key file of
 * its own (the daemon connecting to the user's address). All names here are
 * predictable from the job's name and the nonces the directory shows, so
 * no per-file check could make a shared-writable directory safe -- a file
 * planted first wins, sticky bit or not. Hence: the directory is opened
 * once (not through a symlink), it must belong to the daemon's uid or root
 * and be writable by nobody else (no group or other write), else the
 * fabric is refused naming it; and every file in it is then opened
 * relative to that descriptor, without following symlinks, made with
 * O_EXCL and read only when it is a regular file, Gloo's key-value files
 * included (dir_store below replaces its FileStore, which writes through
 * paths with a truncating open). */
static shardd_err open_rendezvous(const char *path, int *out, char *err,
                                  size_t errlen) {
  *out = -1;
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    snprintf(err, errlen, "fabric: rendezvous directory %s: %s", path,
             e == ELOOP || e == ENOTDIR ? "a symlink or not a directory (name "
                                          "the directory itself)"
                                        : strerror(e));
    return e == ELOOP || e == ENOTDIR ? SHARDD_E_PERMISSION : SHARDD_E_IO;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    snprintf(err, errlen, "fabric: rendezvous directory %s: %s", path,
             strerror(errno));
    close(fd);
    return SHARDD_E_IO;
  }
  uid_t me = geteuid();
  if ((st.st_uid != me && st.st_uid != 0) || (st.st_mode & (S_IWGRP | S_IWOTH))) {
    snprintf(err, errlen, "fabric: rendezvous directory %s (uid %u, mode %04o) "
             "can be written by %s: another user could plant files or "
             "symlinks in it; refused (make it owned by uid %u or root, "
             "chmod go-w)", path, (unsigned)st.st_uid,
             (unsigned)(st.st_mode & 07777),
             st.st_uid != me && st.st_uid != 0 ? "its owner, not this daemon's uid"
                                               : "its group or others",
             (unsigned)me);
    close(fd);
    return SHARDD_E_PERMISSION;
  }
  *out = fd;
  return SHARDD_OK;
}

/* Writes dfd/name whole or not at all (a reader never sees half of it),
 * through a temporary name made anew (a stale one removed first); 0 or an
 * errno. */
static int write_atomic(int dfd, const std::string &name, const std::string &text) {
  std::string tmp = "." + name + ".tmp" + std::to_string(getpid());
  if (unlinkat(dfd, tmp.c_str(), 0) != 0 && errno != ENOENT)
    return errno;
  int fd = openat(dfd, tmp.c_str(),
                  O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0)
    return errno;
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      int e = n < 0 ? errno : EIO;
      close(fd);
      unlinkat(dfd, tmp.c_str(), 0);
      return e;
    }
    done += (size_t)n;
  }
  if (close(fd) != 0 || renameat(dfd, tmp.c_str(), dfd, name.c_str()) != 0) {
    int e = errno;
    unlinkat(dfd, tmp.c_str(), 0);
    return e;
  }
  return 0;
}

/* The text of dfd/name when it is a regular file (no symlink, no FIFO:
 * the open does not wait for a writer), "" when it is missing or not one
 * (a node that has not written it yet). */
static std::string read_small(int dfd, const std::string &name) {
  int fd = openat(dfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    return "";
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return "";
  }
  char buf[4096];
  std::string out;
  for (;;) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      break;
    out.append(buf, (size_t)n);
    if (out.size() > (size_t(1) << 20)) /* not ours */
      break;
  }
  close(fd);
  return out;
}

/* Gloo's key-value store on the rendezvous directory's descriptor: what
 * gloo::rendezvous::FileStore does (a key is a file, written whole, waited
 * for by polling, which works on NFS), with the files opened as above.
 * Keys (Gloo's, under the job's namespace) map to hashed names. */
class dir_store : public gloo::rendezvous::Store {
public:
  dir_store(int dfd, std::string path) : dfd_(dfd), path_(std::move(path)) {}

  void set(const std::string &key, const std::vector<char> &data) override {
    std::string name = name_of(key);
    names_.push_back(name);
    int e = write_atomic(dfd_, name, std::string(data.begin(), data.end()));
    if (e != 0)
      throw std::runtime_error("cannot write " + path_ + "/" + name + ": " +
                               strerror(e));
  }

  std::vector<char> get(const std::string &key) override {
    wait({key});
    std::string text = read_small(dfd_, name_of(key));
    if (text.empty())
      throw std::runtime_error("cannot read " + path_ + "/" + name_of(key));
    return std::vector<char>(text.begin(), text.end());
  }

  void wait(const std::vector<std::string> &keys) override {
    wait(keys, kDefaultTimeout);
  }

  void wait(const std::vector<std::string> &keys,
            const std::chrono::milliseconds &timeout) override {
    auto end = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      bool all = true;
      for (const auto &k : keys) {
        struct stat st;
        if (fstatat(dfd_, name_of(k).c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 ||
            !S_ISREG(st.st_mode) || st.st_size == 0) {
          all = false;
          break;
        }
      }
      if (all)
        return;
      if (std::chrono::steady_clock::now() >= end)
        throw std::runtime_error("timed out waiting in " + path_ +
                                 " for another node's address");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  /* the files this node wrote, removed with the fabric */
  const std::vector<std::string> &names() const { return names_; }

private:
  static std::string name_of(const std::string &key) {
    return "shardd-kv-" + hex64(fnv64(key)) + hex64(fnv64("kv:" + key));
  }
  int dfd_;
  std::string path_;
  std::vector<std::string> names_;
};

static const char kMagic[] = "shardd-rendezvous 1 ";

/* The nonce in an announcement file, "" when it is not one. */
static std::string nonce_of(const std::string &text) {
  size_t m = sizeof kMagic - 1;
  if (text.compare(0, m, kMagic) != 0 || text.size() < m + 16)
    return "";
  std::string n = text.substr(m, 16);
  return n.find_first_not_of("0123456789abcdef") == std::string::npos ? n : "";
}

/* A file name for the job: readable, and distinct even where the
 * sanitizing maps two names alike. */
static std::string file_base(const std::string &prefix) {
  std::string clean;
  for (char ch : prefix.substr(0, 64))
    clean += isalnum((unsigned char)ch) || ch == '-' || ch == '_' || ch == '.' ? ch : '_';
  char h[9];
  snprintf(h, sizeof h, "%08x", (unsigned)(fnv64(prefix) & 0xffffffffu));
  return "shardd-" + clean + "-" + h;
}

static std::string node_list(const std::vector<uint32_t> &v) {
  std::string s;
  for (size_t i = 0; i < v.size(); i++)
    s += (i ? (i + 1 == v.size() ? " and " : ", ") : "") + std::to_string(v[i]);
  return s;
}

/* Agrees with the other nodes on this incarnation's namespace (see the top
 * of the file); SHARDD_OK and *epoch, or an error in err. */
static shardd_err agree(const shardd__fabric_opts *o, int dfd,
                        std::chrono::steady_clock::time_point deadline,
                        std::string *epoch, char *err, size_t errlen) {
  const std::string base = file_base(o->prefix);
  auto ann = [&](uint32_t n) { return base + ".node" + std::to_string(n); };
  const std::string mine = hex64(fresh_nonce());
  const char *host = o->host && o->host[0] ? o->host : "127.0.0.1";
  int e = write_atomic(dfd, ann(o->node_rank), kMagic + mine + " " + host + "\n");
  if (e != 0) {
    snprintf(err, errlen, "fabric: rendezvous: cannot write %s/%s: %s",
             o->rendezvous, ann(o->node_rank).c_str(), strerror(e));
    return SHARDD_E_IO;
  }
  std::string written; /* the .seen text last written */
  std::vector<uint32_t> absent, unconfirmed;
  for (;;) {
    absent.clear();
    unconfirmed.clear();
    std::string list;
    for (uint32_t n = 0; n < o->nodes; n++) {
      std::string v = n == o->node_rank ? mine : nonce_of(read_small(dfd, ann(n)));
      if (v.empty())
        absent.push_back(n);
      list += (n ? "," : "") + v;
    }
    if (absent.empty()) {
      std::string seen = kMagic + list + "\n";
      if (seen != written) {
        e = write_atomic(dfd, ann(o->node_rank) + ".seen", seen);
        if (e != 0) {
          snprintf(err, errlen, "fabric: rendezvous: cannot write %s/%s.seen: %s",
                   o->rendezvous, ann(o->node_rank).c_str(), strerror(e));
          return SHARDD_E_IO;
        }
        written = seen;
      }
      for (uint32_t n = 0; n < o->nodes; n++)
        if (n != o->node_rank && read_small(dfd, ann(n) + ".seen") != seen)
          unconfirmed.push_back(n);
      if (unconfirmed.empty()) {
        *epoch = hex64(fnv64(list));
        return SHARDD_OK;
      }
    }
    if (o->stop && o->stop(o->stop_arg)) {
      snprintf(err, errlen, "fabric: rendezvous in %s abandoned: this daemon "
               "is stopping", o->rendezvous);
      return SHARDD_E_SHUTDOWN;
    }
    if (std::chrono::steady_clock::now() >= deadline)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::vector<uint32_t> &gone = absent.empty() ? unconfirmed : absent;
  snprintf(err, errlen,
           "fabric: node%s %s of %" PRIu32 " did not join the rendezvous in %s "
           "within %.0f s%s",
           gone.size() == 1 ? "" : "s", node_list(gone).c_str(), o->nodes,
           o->rendezvous, o->timeout_s,
           absent.empty() ? " (what is there of them is from an earlier run)" : "");
  return SHARDD_E_PEER_LOST;
}

/* ---- the interface ------------------------------------------------------- */

extern "C" shardd_err shardd__fabric_create(const shardd__fabric_opts *o,
                                            shardd__fabric **out, char *err,
                                            size_t errlen) {
  if (out == nullptr)
    return SHARDD_E_INVAL;
  *out = nullptr;
  if (o == nullptr || o->size < sizeof *o || o->rendezvous == nullptr ||
      o->prefix == nullptr || o->nodes < 2 || o->node_rank >= o->nodes ||
      !(o->timeout_s > 0)) {
    put(err, errlen, "fabric", "invalid options");
    return SHARDD_E_INVAL;
  }
  return guarded(err, errlen, "fabric", SHARDD_E_IO, [&]() -> shardd_err {
    std::unique_ptr<shardd__fabric> f(new shardd__fabric);
    f->nodes = o->nodes;
    f->node_rank = o->node_rank;
    double t = std::min(o->timeout_s, kMaxTimeoutS);
    f->timeout = std::chrono::milliseconds(std::max<long long>(1, std::llround(t * 1000.0)));
    auto deadline = std::chrono::steady_clock::now() + f->timeout;
    const std::string host = o->host && o->host[0] ? o->host : "127.0.0.1";
    shardd_err rc = guarded(err, errlen, ("fabric: tcp device on " + host).c_str(),
                            SHARDD_E_IO, [&]() -> shardd_err {
                              gloo::transport::tcp::attr attr;
                              attr.hostname = host;
                              f->dev = gloo::transport::tcp::CreateDevice(attr);
                              return SHARDD_OK;
                            });
    if (rc != SHARDD_OK)
      return rc;
    if ((rc = open_rendezvous(o->rendezvous, &f->dir, err, errlen)) != SHARDD_OK)
      return rc;
    std::string epoch;
    if ((rc = agree(o, f->dir, deadline, &epoch, err, errlen)) != SHARDD_OK) {
      close(f->dir);
      return rc;
    }
    rc = guarded(err, errlen, "fabric: rendezvous", SHARDD_E_PEER_LOST,
                 [&]() -> shardd_err {
                   dir_store fs(f->dir, o->rendezvous);
                   gloo::rendezvous::PrefixStore store(std::string(o->prefix) + "/" + epoch, fs);
                   f->ctx = std::make_shared<gloo::rendezvous::Context>(
                       (int)o->node_rank, (int)o->nodes);
                   f->ctx->setTimeout(f->timeout);
                   try {
                     f->ctx->connectFullMesh(store, f->dev);
                   } catch (...) {
                     f->keys = fs.names();
                     throw;
                   }
                   f->keys = fs.names();
                   return SHARDD_OK;
                 });
    if (rc != SHARDD_OK) {
      for (const auto &k : f->keys)
        unlinkat(f->dir, k.c_str(), 0);
      close(f->dir);
      return rc;
    }
    *out = f.release();
    return SHARDD_OK;
  });
}

/* A failed operation leaves the context unusable (Gloo pairs latch their
 * first error, and a timeout closes every pair of the context); the caller
 * marks the job's fabric broken. */

/* The allgather of buf (nodes parts of bytes_per_node, this node's at its
 * place) on slot; throws as Gloo does, and aborted_error. */
static void allgather(shardd__fabric *f, void *buf, size_t bytes_per_node,
                      uint64_t slot) {
  const size_t N = f->nodes, r = f->node_rank;
  if (bytes_per_node == 0)
    return; /* every node's header says the same size: all skip alike */
  auto ub = f->ctx->createUnboundBuffer(buf, N * bytes_per_node);
  watched w(f, ub.get());
  /* several sends and receives pending on one buffer at once, on disjoint
   * parts, as Gloo's own alltoall and ring allgather post them */
  for (size_t n = 0; n < N; n++) {
    if (n == r)
      continue;
    ub->recv((int)n, slot, n * bytes_per_node, bytes_per_node);
    ub->send((int)n, slot, r * bytes_per_node, bytes_per_node);
  }
  for (size_t k = 0; k + 1 < N; k++)
    wait_recv(f, ub.get());
  for (size_t k = 0; k + 1 < N; k++)
    wait_send(f, ub.get());
}

extern "C" shardd_err shardd__fabric_allgather(shardd__fabric *f, void *buf,
                                               size_t bytes_per_node,
                                               uint32_t tag, char *err,
                                               size_t errlen) {
  return fabric_op(f, err, errlen, "fabric allgather", [&]() -> shardd_err {
    allgather(f, buf, bytes_per_node, gloo::Slot::build(kAllgatherSlotPrefix, tag));
    return SHARDD_OK;
  });
}

static void add_f32(float *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n; i++)
    dst[i] += src[i];
}

extern "C" shardd_err shardd__fabric_reduce_scatter_f32(shardd__fabric *f,
                                                        float *buf,
                                                        size_t count,
                                                        uint32_t tag,
                                                        char *err,
                                                        size_t errlen) {
  return fabric_op(f, err, errlen, "fabric reduce-scatter", [&]() -> shardd_err {
    const size_t N = f->nodes, r = f->node_rank;
    const int next = (int)((r + 1) % N), prev = (int)((r + N - 1) % N);
    const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
    const size_t seg = std::max<size_t>(1, std::min(count, kSegmentBytes / 4));
    const size_t nseg = (count + seg - 1) / seg;
    /* declared before the buffers that point into it, so it
     * outlives them when an exception unwinds */
    std::vector<float> scratch(2 * seg);
    auto out = f->ctx->createUnboundBuffer(buf, N * count * 4);
    watched wo(f, out.get());
    auto tmp = f->ctx->createUnboundBuffer(scratch.data(), scratch.size() * 4);
    watched wt(f, tmp.get());
    auto len = [&](size_t k) { return std::min(seg, count - k * seg); };
    for (size_t s = 0; s + 1 < N; s++) {
      const size_t send_part = (r + 2 * N - s - 1) % N;
      const size_t recv_part = (r + 2 * N - s - 2) % N;
      /* this step reads send_part and writes recv_part only */
      for (size_t k = 0; k < nseg; k++)
        out->send(next, slot, (send_part * count + k * seg) * 4, len(k) * 4);
      for (size_t k = 0; k < nseg && k < 2; k++)
        tmp->recv(prev, slot, (k % 2) * seg * 4, len(k) * 4);
      for (size_t k = 0; k < nseg; k++) {
        /* one pair, one slot: segments complete in order */
        wait_recv(f, tmp.get());
        add_f32(buf + recv_part * count + k * seg, scratch.data() + (k % 2) * seg, len(k));
        if (k + 2 < nseg)
          tmp->recv(prev, slot, (k % 2) * seg * 4, len(k + 2) * 4);
      }
      for (size_t k = 0; k < nseg; k++)
        wait_send(f, out.get());
    }
    return SHARDD_OK;
  });
}

extern "C" void shardd__fabric_abort(shardd__fabric *f, const char *why) {
  if (f == nullptr)
    return;
  std::lock_guard<std::mutex> g(f->mu);
  if (f->aborted)
    return;
  try {
    f->why = why ? why : "aborted";
  } catch (...) {
    /* no memory for the reason: the abort still happens, without it */
  }
  f->aborted = true;
  for (auto *b : f->live) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
}

extern "C" void shardd__fabric_destroy(shardd__fabric *f) {
  if (f == nullptr)
    return;
  try {
    /* the context's pairs hold the device by raw pointer: context first */
    f->ctx.reset();
    f->dev.reset();
    for (const auto &k : f->keys)
      unlinkat(f->dir, k.c_str(), 0);
  } catch (...) {
  }
  close(f->dir);
  delete f;
}

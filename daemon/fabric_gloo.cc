/* fabric_gloo.cc — the fabric (fabric.h) on Gloo: TCP transport, one
 * gloo::rendezvous::Context per job with one member per node, rendezvous
 * through gloo::rendezvous::FileStore under a PrefixStore for the job.
 * Every Gloo exception is caught here and turned into a shardd_err with its
 * message; nothing C++ crosses the C interface.
 *
 * Reduce-scatter: this Gloo snapshot (Debian 0.0~git20220518) has no
 * tag-based reduce_scatter; its only one, ReduceScatterHalvingDoubling, is
 * a legacy algorithm object that takes context slots from nextSlot() (not
 * thread-safe, so concurrent collectives of one job would have to be
 * created in the same order on every node) and counts elements in an int.
 * So the reduce-scatter is gloo::allreduce (ring, tagged, with a timeout)
 * over the whole buffer, of which the caller keeps its node's part: twice
 * the minimum traffic, still one copy per node and never per rank. */
#include "fabric.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

struct shardd__fabric {
  std::shared_ptr<gloo::transport::Device> dev;
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  std::chrono::milliseconds timeout;
  uint32_t nodes, node_rank;
};

static void put(char *err, size_t errlen, const char *what, const char *msg) {
  if (err && errlen)
    snprintf(err, errlen, "%s: %s", what, msg);
}

extern "C" const char *shardd__fabric_engine(void) { return "gloo"; }

extern "C" shardd_err shardd__fabric_create(const shardd__fabric_opts *o,
                                            shardd__fabric **out, char *err,
                                            size_t errlen) {
  *out = nullptr;
  if (o == nullptr || o->size < sizeof *o || o->rendezvous == nullptr ||
      o->prefix == nullptr || o->nodes < 2 || o->node_rank >= o->nodes ||
      !(o->timeout_s > 0)) {
    put(err, errlen, "fabric", "invalid options");
    return SHARDD_E_INVAL;
  }
  std::unique_ptr<shardd__fabric> f(new (std::nothrow) shardd__fabric);
  if (!f) {
    put(err, errlen, "fabric", "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  f->nodes = o->nodes;
  f->node_rank = o->node_rank;
  f->timeout = std::chrono::milliseconds((long)(o->timeout_s * 1000.0));
  const std::string host = o->host && o->host[0] ? o->host : "127.0.0.1";
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    f->dev = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception &e) {
    char what[160];
    snprintf(what, sizeof what, "fabric: tcp device on %s", host.c_str());
    put(err, errlen, what, e.what());
    return SHARDD_E_IO;
  }
  try {
    gloo::rendezvous::FileStore fs(o->rendezvous);
    gloo::rendezvous::PrefixStore store(o->prefix, fs);
    /* Announce this node, then wait for every other one with one deadline,
     * so a timeout names exactly the nodes that never came. */
    std::string me = "node" + std::to_string(o->node_rank);
    store.set(me, std::vector<char>(host.begin(), host.end()));
    auto deadline = std::chrono::steady_clock::now() + f->timeout;
    std::string missing;
    for (uint32_t n = 0; n < o->nodes; n++) {
      if (n == o->node_rank)
        continue;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() < 1)
        left = std::chrono::milliseconds(1);
      try {
        store.wait({"node" + std::to_string(n)}, left);
      } catch (const std::exception &) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(n);
      }
    }
    if (!missing.empty()) {
      snprintf(err, errlen,
               "fabric: node%s %s of %u did not join the rendezvous in %s "
               "within %.0f s",
               missing.find(',') == std::string::npos ? "" : "s",
               missing.c_str(), o->nodes, o->rendezvous, o->timeout_s);
      return SHARDD_E_PEER_LOST;
    }
    f->ctx = std::make_shared<gloo::rendezvous::Context>((int)o->node_rank,
                                                         (int)o->nodes);
    f->ctx->setTimeout(f->timeout);
    f->ctx->connectFullMesh(store, f->dev);
  } catch (const std::exception &e) {
    put(err, errlen, "fabric: rendezvous", e.what());
    return SHARDD_E_PEER_LOST;
  }
  *out = f.release();
  return SHARDD_OK;
}

/* A failed operation leaves the context unusable (Gloo pairs latch their
 * first error); the caller marks the job's fabric broken. */
static shardd_err fail(char *err, size_t errlen, const char *what,
                       const std::exception &e) {
  put(err, errlen, what, e.what());
  return SHARDD_E_PEER_LOST;
}

extern "C" shardd_err shardd__fabric_allgather(shardd__fabric *f, void *buf,
                                               size_t bytes_per_node,
                                               uint32_t tag, char *err,
                                               size_t errlen) {
  try {
    gloo::AllgatherOptions opts(f->ctx);
    /* no input: in place, this node's part is already in the output */
    opts.setOutput(static_cast<uint8_t *>(buf), bytes_per_node * f->nodes);
    opts.setTag(tag);
    opts.setTimeout(f->timeout);
    gloo::allgather(opts);
  } catch (const std::exception &e) {
    return fail(err, errlen, "fabric allgather", e);
  }
  return SHARDD_OK;
}

extern "C" shardd_err shardd__fabric_reduce_scatter_f32(shardd__fabric *f,
                                                        float *buf,
                                                        size_t count,
                                                        uint32_t tag,
                                                        char *err,
                                                        size_t errlen) {
  try {
    gloo::AllreduceOptions opts(f->ctx);
    opts.setOutput(buf, count * f->nodes);
    void (*fn)(void *, const void *, const void *, size_t) = &gloo::sum<float>;
    opts.setReduceFunction(fn);
    opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    opts.setTag(tag);
    opts.setTimeout(f->timeout);
    gloo::allreduce(opts);
  } catch (const std::exception &e) {
    return fail(err, errlen, "fabric reduce-scatter", e);
  }
  return SHARDD_OK;
}

extern "C" shardd_err shardd__fabric_allreduce_f64(shardd__fabric *f,
                                                   double *v, uint32_t tag,
                                                   char *err, size_t errlen) {
  try {
    gloo::AllreduceOptions opts(f->ctx);
    opts.setOutput(v, 1);
    void (*fn)(void *, const void *, const void *, size_t) = &gloo::sum<double>;
    opts.setReduceFunction(fn);
    opts.setTag(tag);
    opts.setTimeout(f->timeout);
    gloo::allreduce(opts);
  } catch (const std::exception &e) {
    return fail(err, errlen, "fabric allreduce", e);
  }
  return SHARDD_OK;
}

extern "C" shardd_err shardd__fabric_barrier(shardd__fabric *f, uint32_t tag,
                                             char *err, size_t errlen) {
  try {
    gloo::BarrierOptions opts(f->ctx);
    opts.setTag(tag);
    opts.setTimeout(f->timeout);
    gloo::barrier(opts);
  } catch (const std::exception &e) {
    return fail(err, errlen, "fabric barrier", e);
  }
  return SHARDD_OK;
}

extern "C" void shardd__fabric_destroy(shardd__fabric *f) {
  if (f == nullptr)
    return;
  try {
    f->ctx.reset();
    f->dev.reset();
  } catch (...) {
  }
  delete f;
}

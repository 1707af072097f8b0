#include "ucx_fix.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <ucp/api/ucp.h>
#include <ucs/datastruct/mpool.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

// UCX 1.22's software GET (every READ over TCP: the reader sends GET_REQ, the owner of the
// memory answers from its progress) allocates the reply request in ucp_get_req_handler
// (src/ucp/rma/rma_sw.c) without setting its `send.datatype`; the field keeps whatever the
// request memory pool's previous user left there. While the reply is sent, nothing reads it. But
// when the endpoint fails with the reply still queued (the peer died or its connection was reset
// while the socket's send buffer was full), uct_tcp_ep_pending_purge hands it to
// ucp_request_send_state_ff, which deregisters the request's memory by that datatype: when the
// stale value's class bits say IOV, it walks a garbage array of memory handles, and the process
// dies of SIGSEGV (core dumps of P's sidecar: ucp_request_dt_dereg <- ucp_request_memory_dereg
// <- ucp_request_send_state_ff <- uct_tcp_ep_pending_purge_cb; unchanged on UCX master of
// 2026-08). So a D that died mid-pull could take P down with it (2 of 4 runs of a SIGKILL under
// a capped link, test/sidecar/multiprocess/peer-death.test.ts).
//
// The fix, without rebuilding UCX: the GET_REQ handler is replaced by one that first writes a
// contiguous datatype into the request the original is about to take (the head of the worker's
// request pool's free list: ucs_mpool_get_inline takes the head), then calls the original. The
// original then sets `send.state.dt.dt.contig.memh = NULL`, so the purge's deregistration is a
// no-op. It needs three offsets of UCX's private structures, so it is installed only on the
// build whose layout they were read from (gdb `ptype /o` on the pinned wheel's debug info):
// libucp.so with the GNU build ID below, the one scripts/setup-ucx.sh installs. On any other
// libucp nothing is touched (Describe() says so).
namespace kvxfer {

namespace {

// libucp.so of libucx-cu12 1.22.0 (native/ucx/requirements.txt).
constexpr char kPinnedBuildId[] = "505db35aae3841cec813927dfbc5f14f5f64da61";
// offsetof(ucp_worker_t, req_mp)
constexpr size_t kWorkerReqMp = 0x78;
// offsetof(ucp_worker_iface_t, worker): a proxy handler's argument is the worker iface.
constexpr size_t kIfaceWorker = 544;
// offsetof(ucp_request_t, send.datatype)
constexpr size_t kRequestSendDatatype = 40;
// sizeof(ucp_request_t): the request pool's elements hold at least this after their header.
constexpr size_t kRequestSize = 280;

// uct_am_callback_t (uct/api/uct.h).
using AmCallback = ucs_status_t (*)(void* arg, void* data, size_t length, unsigned flags);

// ucp_am_handler_t (src/ucp/core/ucp_am.h), the exported ucp_am_handler_UCP_AM_ID_GET_REQ.
struct AmHandler {
  uint64_t features;
  AmCallback cb;
  void* tracer;
  uint32_t flags;
  AmCallback proxy_cb;
};

AmCallback g_original_cb = nullptr;
AmCallback g_original_proxy = nullptr;
std::atomic<uint64_t> g_primed{0};
std::atomic<bool> g_off{false};
std::string g_state = "not installed yet";
std::once_flag g_once;

void Prime(void* worker) {
  if (worker == nullptr || g_off.load(std::memory_order_relaxed)) return;
  auto* mp = reinterpret_cast<ucs_mpool_t*>(static_cast<char*>(worker) + kWorkerReqMp);
  if (mp->freelist == nullptr) {
    // An empty free list makes ucp_request_get grow the pool: grow it here instead, and put the
    // element back, so the one the handler takes is the one written below.
    void* obj = ucs_mpool_get(mp);
    if (obj == nullptr) return;
    ucs_mpool_put(obj);
    if (mp->freelist == nullptr) return;
  }
  char* req = reinterpret_cast<char*>(mp->freelist + 1);
  uint64_t contig = ucp_dt_make_contig(1);
  std::memcpy(req + kRequestSendDatatype, &contig, sizeof(contig));
  g_primed.fetch_add(1, std::memory_order_relaxed);
}

ucs_status_t FixedGetReq(void* arg, void* data, size_t length, unsigned flags) {
  Prime(arg);
  return g_original_cb(arg, data, length, flags);
}

ucs_status_t FixedGetReqProxy(void* arg, void* data, size_t length, unsigned flags) {
  Prime(*reinterpret_cast<void**>(static_cast<char*>(arg) + kIfaceWorker));
  return g_original_proxy(arg, data, length, flags);
}

struct FindBuildId {
  uintptr_t base;
  std::string id;
  std::string path;
};

int OnObject(struct dl_phdr_info* info, size_t, void* arg) {
  auto* find = static_cast<FindBuildId*>(arg);
  if (info->dlpi_addr != find->base) return 0;
  find->path = info->dlpi_name != nullptr ? info->dlpi_name : "";
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_NOTE) continue;
    const char* p = reinterpret_cast<const char*>(info->dlpi_addr + ph.p_vaddr);
    const char* end = p + ph.p_memsz;
    while (p + sizeof(ElfW(Nhdr)) <= end) {
      const auto* nh = reinterpret_cast<const ElfW(Nhdr)*>(p);
      const char* name = p + sizeof(ElfW(Nhdr));
      const unsigned char* desc =
          reinterpret_cast<const unsigned char*>(name + ((nh->n_namesz + 3) & ~3u));
      if (nh->n_type == NT_GNU_BUILD_ID && nh->n_namesz == 4 && std::memcmp(name, "GNU", 4) == 0) {
        char hex[3];
        for (uint32_t k = 0; k < nh->n_descsz; ++k) {
          std::snprintf(hex, sizeof(hex), "%02x", desc[k]);
          find->id += hex;
        }
        return 1;
      }
      p = reinterpret_cast<const char*>(desc) + ((nh->n_descsz + 3) & ~3u);
    }
  }
  return 1;
}

void Install() {
  if (const char* off = std::getenv("KVXFER_UCX_GET_REPLY_FIX");
      off != nullptr && std::strcmp(off, "0") == 0) {
    g_state = "not installed: KVXFER_UCX_GET_REPLY_FIX=0";
    return;
  }
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&ucp_init_version), &info) == 0 || info.dli_fbase == nullptr) {
    g_state = "not installed: libucp.so not found in this process";
    return;
  }
  FindBuildId find{reinterpret_cast<uintptr_t>(info.dli_fbase), "", ""};
  dl_iterate_phdr(&OnObject, &find);
  if (find.id != kPinnedBuildId) {
    g_state = "not installed: libucp.so (" + std::string(info.dli_fname) + ", build ID " +
              (find.id.empty() ? "none" : find.id) + ") is not the pinned UCX 1.22.0 (" +
              kPinnedBuildId + ")";
    return;
  }
  void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  void* sym = lib != nullptr ? dlsym(lib, "ucp_am_handler_UCP_AM_ID_GET_REQ") : nullptr;
  if (lib != nullptr) dlclose(lib);
  auto* handler = static_cast<AmHandler*>(sym);
  if (handler == nullptr || handler->cb == nullptr || handler->features != UCP_FEATURE_RMA) {
    g_state = "not installed: no GET request handler to replace in libucp.so";
    return;
  }
  g_original_cb = handler->cb;
  g_original_proxy = handler->proxy_cb;
  handler->cb = &FixedGetReq;
  if (handler->proxy_cb != nullptr) handler->proxy_cb = &FixedGetReqProxy;
  g_state = "installed";
}

}  // namespace

void InstallUcxGetReplyFix() { std::call_once(g_once, Install); }

void CheckUcxGetReplyFix(ucp_worker_h worker) {
  if (g_original_cb == nullptr || g_off.load()) return;
  // The build ID already pins the layout; this confirms the offset of the request pool.
  auto* mp = reinterpret_cast<ucs_mpool_t*>(reinterpret_cast<char*>(worker) + kWorkerReqMp);
  if (mp->data == nullptr || std::strcmp(ucs_mpool_name(mp), "ucp_requests") != 0 ||
      mp->data->elem_size < sizeof(ucs_mpool_elem_t) + kRequestSize) {
    g_off.store(true);
    g_state = "switched off: the worker's request pool is not where the pinned build has it";
  }
}

std::string UcxGetReplyFixState() {
  return g_state + " (" + std::to_string(g_primed.load(std::memory_order_relaxed)) +
         " GET replies primed)";
}

}  // namespace kvxfer

// objectcache_backend.cpp: a NIXL backend plugin ("OBJECTCACHE") over ObjectCache's C ABI.
//
// A thin shim: every transfer becomes objectcache_load / objectcache_save on one
// objectcache_engine; nothing of ObjectCache is reimplemented here. Built against the
// headers of one pinned NIXL version (see docs/nixl.md and the Makefile beside this file).
//
// Memory kinds: DRAM_SEG (local buffers) and OBJ_SEG (KV chunks). An OBJ_SEG descriptor names
// one KV chunk: metaInfo is the chunk hash in hex (or, when empty, devId's 8 bytes little
// endian); its addr/len select a byte range of the chunk's layer-major payload (layer l's K
// then V at l x slice_bytes, checksums excluded), in whole layers.
//
// READ (load): one objectcache_load per transfer over the distinct chunks, into a staging
// buffer; checkXfer copies each descriptor out as soon as all its layers are ready, and
// getNotifs reports "<notif>:layer:<l>" per ready layer (when the transfer has a notification
// message) and "<notif>" at completion. WRITE (save): every chunk must be covered whole; one
// objectcache_save per transfer on a helper thread (postXfer never blocks). queryMem tells
// whether each OBJ_SEG chunk is published.
//
// Per-transfer custom parameter (opt_args->customParam): "key=value;..." with request_id,
// priority, deadline_ms, compute_us_per_layer (ObjectCache scheduling hints) and
// layer_notifs=0|1.
#include "backend/backend_engine.h"
#include "backend/backend_plugin.h"
#include "nixl_types.h"

#include <objectcache.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

const char *kName = "OBJECTCACHE";
const char *kVersion = "0.1.0";

// Keys of the backend's init parameters: the engine's (passed to objectcache_engine_create)
// and the KV geometry's.
const char *kEngineKeys[] = {"store", "namespace", "hash_algo", "window_bytes", "max_requests",
                             "coalesce_bytes", "lookup_fanout", "lookup_cache_ttl_ms",
                             "load_timeout_ms", "save_concurrency", "worker_threads"};
const char *kGeometryKeys[] = {"model", "layers", "kv_heads", "head_dim", "dtype",
                               "tokens_per_chunk", "tp_rank", "tp_world"};

void
logError(const std::string &what, objectcache_status s) {
    std::fprintf(stderr, "objectcache-nixl: %s: %s: %s\n", what.c_str(),
                 objectcache_status_name(s), objectcache_last_error());
}

nixl_status_t
toNixl(objectcache_status s) {
    switch (s) {
    case OBJECTCACHE_OK:
        return NIXL_SUCCESS;
    case OBJECTCACHE_PENDING:
        return NIXL_IN_PROG;
    case OBJECTCACHE_ERR_INVALID_ARGUMENT:
    case OBJECTCACHE_ERR_CONFIG:
        return NIXL_ERR_INVALID_PARAM;
    case OBJECTCACHE_ERR_UNSUPPORTED:
        return NIXL_ERR_NOT_SUPPORTED;
    case OBJECTCACHE_ERR_NOT_FOUND:
    case OBJECTCACHE_ERR_LAYER_MISSING:
        return NIXL_ERR_NOT_FOUND;
    case OBJECTCACHE_ERR_CANCELLED:
        return NIXL_ERR_CANCELED;
    default:
        return NIXL_ERR_BACKEND;
    }
}

bool
parseHex(const std::string &hex, std::vector<uint8_t> &out) {
    if (hex.empty() || hex.size() % 2 || hex.size() > 128) return false;
    out.clear();
    for (size_t i = 0; i < hex.size(); i += 2) {
        char b[3] = {hex[i], hex[i + 1], 0};
        char *end = nullptr;
        long v = std::strtol(b, &end, 16);
        if (end != b + 2) return false;
        out.push_back(static_cast<uint8_t>(v));
    }
    return true;
}

std::map<std::string, std::string>
parseKv(const std::string &s) {
    std::map<std::string, std::string> m;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ';')) {
        auto eq = item.find('=');
        if (eq != std::string::npos) m[item.substr(0, eq)] = item.substr(eq + 1);
    }
    return m;
}

// Backend metadata of one registered descriptor.
class OcMD : public nixlBackendMD {
public:
    explicit OcMD(nixl_mem_t kind) : nixlBackendMD(true), kind(kind) {}
    nixl_mem_t kind;
    std::vector<uint8_t> hash; // OBJ_SEG: the chunk hash
};

// One descriptor pair of a transfer.
struct Piece {
    uint8_t *local;
    size_t len;
    size_t chunk;        // index into Req::hashes
    uint32_t firstLayer; // first layer covered
    uint32_t lastLayer;  // one past the last layer covered
    size_t offset;       // byte offset into the chunk's layer-major payload
    bool done = false;
};

class OcReq : public nixlBackendReqH {
public:
    nixl_xfer_op_t op;
    std::vector<std::vector<uint8_t>> hashes; // distinct chunks, in first-use order
    std::vector<Piece> pieces;
    objectcache_load_params hints{};
    bool layerNotifs = true;
    std::string notif;
    bool hasNotif = false;
    // Load state.
    std::vector<uint8_t> staging;
    objectcache_region *region = nullptr;
    objectcache_transfer *transfer = nullptr;
    std::vector<int> layerState; // 0 pending, 1 ready, -1 failed
    std::vector<bool> layerNotified;
    bool completeNotified = false;
    // Save state.
    std::thread saver;
    std::atomic<int> saveStatus{OBJECTCACHE_PENDING};
    std::mutex mu;
};

class nixlObjectCacheEngine : public nixlBackendEngine {
public:
    explicit nixlObjectCacheEngine(const nixlBackendInitParams *init)
        : nixlBackendEngine(init), agent_(init->localAgent) {
        const nixl_b_params_t &p = *init->customParams;
        std::vector<const char *> keys, vals;
        for (const char *k : kEngineKeys) {
            auto it = p.find(k);
            if (it != p.end() && !it->second.empty()) {
                keys.push_back(k);
                vals.push_back(it->second.c_str());
            }
        }
        objectcache_status s = objectcache_engine_create(OBJECTCACHE_ABI_VERSION, keys.data(),
                                                         vals.data(), keys.size(), &engine_);
        if (s != OBJECTCACHE_OK) {
            logError("engine create", s);
            initErr = true;
            return;
        }
        auto get = [&](const char *k, const char *d) {
            auto it = p.find(k);
            return (it == p.end() || it->second.empty()) ? std::string(d) : it->second;
        };
        model_ = get("model", "");
        std::memset(&g_, 0, sizeof g_);
        g_.struct_size = sizeof g_;
        g_.layers = std::stoul(get("layers", "0"));
        g_.kv_heads = std::stoul(get("kv_heads", "0"));
        g_.head_dim = std::stoul(get("head_dim", "0"));
        std::string dt = get("dtype", "bf16");
        g_.dtype = dt == "fp16"   ? OBJECTCACHE_DTYPE_FP16
                   : dt == "fp8"  ? OBJECTCACHE_DTYPE_FP8_E4M3
                   : dt == "fp32" ? OBJECTCACHE_DTYPE_FP32
                                  : OBJECTCACHE_DTYPE_BF16;
        g_.tokens_per_chunk = std::stoul(get("tokens_per_chunk", "256"));
        g_.tp_rank = std::stoul(get("tp_rank", "0"));
        g_.tp_world = std::stoul(get("tp_world", "1"));
        g_.model = model_.c_str();
        s = objectcache_slice_bytes(&g_, &slice_);
        if (s != OBJECTCACHE_OK) {
            logError("geometry (set model, layers, kv_heads, head_dim, dtype, tokens_per_chunk)",
                     s);
            initErr = true;
        }
    }

    ~nixlObjectCacheEngine() override {
        if (engine_) objectcache_engine_destroy(engine_);
    }

    bool
    supportsRemote() const override {
        return false;
    }
    bool
    supportsLocal() const override {
        return true;
    }
    bool
    supportsNotif() const override {
        return true;
    }
    nixl_mem_list_t
    getSupportedMems() const override {
        return {DRAM_SEG, OBJ_SEG};
    }

    nixl_status_t
    registerMem(const nixlBlobDesc &mem, const nixl_mem_t &kind, nixlBackendMD *&out) override {
        if (kind != DRAM_SEG && kind != OBJ_SEG) return NIXL_ERR_NOT_SUPPORTED;
        auto md = std::make_unique<OcMD>(kind);
        if (kind == OBJ_SEG && !chunkHash(mem, md->hash)) return NIXL_ERR_INVALID_PARAM;
        out = md.release();
        return NIXL_SUCCESS;
    }

    nixl_status_t
    deregisterMem(nixlBackendMD *meta) override {
        delete meta;
        return NIXL_SUCCESS;
    }

    nixl_status_t
    connect(const std::string &) override {
        return NIXL_SUCCESS;
    }
    nixl_status_t
    disconnect(const std::string &) override {
        return NIXL_SUCCESS;
    }
    nixl_status_t
    unloadMD(nixlBackendMD *) override {
        return NIXL_SUCCESS; // loadLocalMD hands out the registration's own metadata
    }
    nixl_status_t
    loadLocalMD(nixlBackendMD *input, nixlBackendMD *&output) override {
        output = input;
        return NIXL_SUCCESS;
    }

    nixl_status_t
    queryMem(const nixl_reg_dlist_t &descs, std::vector<nixl_query_resp_t> &resp) const override {
        resp.assign(descs.descCount(), std::nullopt);
        for (int i = 0; i < descs.descCount(); i++) {
            std::vector<uint8_t> h;
            if (!chunkHash(descs[i], h)) return NIXL_ERR_INVALID_PARAM;
            size_t hit = 0;
            objectcache_status s = objectcache_lookup(engine_, &g_, h.data(), h.size(), 1, &hit);
            if (s != OBJECTCACHE_OK) {
                logError("queryMem", s);
                return toNixl(s);
            }
            if (hit == 1)
                resp[i] = nixl_b_params_t{{"size", std::to_string(slice_ * g_.layers)}};
        }
        return NIXL_SUCCESS;
    }

    nixl_status_t
    prepXfer(const nixl_xfer_op_t &op,
             const nixl_meta_dlist_t &local,
             const nixl_meta_dlist_t &remote,
             const std::string &,
             nixlBackendReqH *&handle,
             const nixl_opt_b_args_t *opt) const override {
        if (local.descCount() != remote.descCount() || local.getType() != DRAM_SEG ||
            remote.getType() != OBJ_SEG) {
            std::fprintf(stderr, "objectcache-nixl: transfers go between DRAM_SEG (local) and "
                                 "OBJ_SEG (remote) lists of equal length\n");
            return NIXL_ERR_INVALID_PARAM;
        }
        auto req = std::make_unique<OcReq>();
        req->op = op;
        std::map<std::vector<uint8_t>, size_t> index;
        const uint64_t chunkBytes = slice_ * g_.layers;
        for (int i = 0; i < local.descCount(); i++) {
            const auto *md = static_cast<const OcMD *>(remote[i].metadataP);
            const size_t off = remote[i].addr, len = remote[i].len;
            if (!md || len != local[i].len || len == 0 || off % slice_ || len % slice_ ||
                off + len > chunkBytes) {
                std::fprintf(stderr,
                             "objectcache-nixl: descriptor %d: OBJ_SEG offset %zu and length "
                             "%zu must be whole layers (%llu bytes each) within the chunk's "
                             "%llu bytes, and equal the local length %zu\n",
                             i, off, len, (unsigned long long)slice_,
                             (unsigned long long)chunkBytes, (size_t)local[i].len);
                return NIXL_ERR_INVALID_PARAM;
            }
            auto it = index.find(md->hash);
            size_t c;
            if (it == index.end()) {
                c = req->hashes.size();
                index[md->hash] = c;
                req->hashes.push_back(md->hash);
            } else {
                c = it->second;
            }
            Piece p;
            p.local = reinterpret_cast<uint8_t *>(local[i].addr);
            p.len = len;
            p.chunk = c;
            p.offset = off;
            p.firstLayer = off / slice_;
            p.lastLayer = (off + len) / slice_;
            req->pieces.push_back(p);
        }
        for (size_t c = 1; c < req->hashes.size(); c++)
            if (req->hashes[c].size() != req->hashes[0].size()) return NIXL_ERR_INVALID_PARAM;
        if (op == NIXL_WRITE && !coversWholeChunks(*req)) {
            std::fprintf(stderr, "objectcache-nixl: a WRITE must cover every layer of each "
                                 "chunk exactly once (ObjectCache stores whole chunks)\n");
            return NIXL_ERR_INVALID_PARAM;
        }
        req->hints.struct_size = sizeof req->hints;
        if (opt) {
            auto kv = parseKv(opt->customParam);
            auto num = [&](const char *k) {
                auto it = kv.find(k);
                return it == kv.end() ? 0ull : std::strtoull(it->second.c_str(), nullptr, 10);
            };
            req->hints.request_id = num("request_id");
            req->hints.priority = static_cast<uint32_t>(num("priority"));
            req->hints.deadline_ms = num("deadline_ms");
            req->hints.compute_us_per_layer = num("compute_us_per_layer");
            if (kv.count("layer_notifs")) req->layerNotifs = kv["layer_notifs"] != "0";
        }
        handle = req.release();
        return NIXL_SUCCESS;
    }

    nixl_status_t
    postXfer(const nixl_xfer_op_t &,
             const nixl_meta_dlist_t &,
             const nixl_meta_dlist_t &,
             const std::string &,
             nixlBackendReqH *&handle,
             const nixl_opt_b_args_t *opt) const override {
        auto *req = static_cast<OcReq *>(handle);
        std::lock_guard<std::mutex> l(req->mu);
        if (req->transfer || req->saver.joinable()) return NIXL_ERR_REPOST_ACTIVE;
        req->hasNotif = opt && opt->hasNotif;
        req->notif = opt ? opt->notifMsg : std::string();
        for (auto &p : req->pieces) p.done = false;
        req->completeNotified = false;
        const size_t n = req->hashes.size();
        const size_t hashLen = req->hashes[0].size();
        std::vector<uint8_t> packed;
        for (auto &h : req->hashes) packed.insert(packed.end(), h.begin(), h.end());
        const size_t perLayer = n * slice_;
        req->staging.assign(perLayer * g_.layers, 0);
        if (req->op == NIXL_WRITE) {
            // Gather the pieces into layer-major staging on a helper thread, then save.
            req->saveStatus = OBJECTCACHE_PENDING;
            req->saver = std::thread([this, req, packed, n, hashLen, perLayer] {
                for (auto &p : req->pieces)
                    for (uint32_t l = p.firstLayer; l < p.lastLayer; l++)
                        std::memcpy(&req->staging[l * perLayer + p.chunk * slice_],
                                    p.local + (l - p.firstLayer) * slice_, slice_);
                std::vector<const void *> layers(g_.layers);
                for (uint32_t l = 0; l < g_.layers; l++)
                    layers[l] = &req->staging[l * perLayer];
                objectcache_status s =
                    objectcache_save(engine_, &g_, packed.data(), hashLen, n, layers.data(),
                                     g_.layers, perLayer, nullptr);
                if (s != OBJECTCACHE_OK) logError("save", s);
                req->saveStatus = s;
            });
            return NIXL_IN_PROG;
        }
        objectcache_status s = objectcache_register_memory(
            engine_, req->staging.data(), req->staging.size(), OBJECTCACHE_MEM_HOST, 0,
            &req->region);
        if (s != OBJECTCACHE_OK) {
            logError("register staging", s);
            return toNixl(s);
        }
        std::vector<objectcache_layer_dest> dests(g_.layers);
        for (uint32_t l = 0; l < g_.layers; l++) {
            dests[l].addr = &req->staging[l * perLayer];
            dests[l].len = perLayer;
        }
        objectcache_load_params lp = req->hints;
        lp.geometry = &g_;
        lp.hashes = packed.data();
        lp.hash_len = hashLen;
        lp.n_chunks = n;
        lp.layers = dests.data();
        lp.n_layers = g_.layers;
        s = objectcache_load(engine_, &lp, &req->transfer);
        if (s != OBJECTCACHE_OK) {
            logError("load", s);
            return toNixl(s);
        }
        req->layerState.assign(g_.layers, 0);
        req->layerNotified.assign(g_.layers, false);
        {
            std::lock_guard<std::mutex> g(activeMu_);
            active_.insert(req);
        }
        return NIXL_IN_PROG;
    }

    nixl_status_t
    checkXfer(nixlBackendReqH *handle) const override {
        auto *req = static_cast<OcReq *>(handle);
        std::lock_guard<std::mutex> l(req->mu);
        if (req->op == NIXL_WRITE) {
            int s = req->saveStatus.load();
            if (s == OBJECTCACHE_PENDING) return NIXL_IN_PROG;
            if (req->saver.joinable()) req->saver.join();
            if (s == OBJECTCACHE_OK && req->hasNotif && !req->completeNotified) {
                req->completeNotified = true;
                std::lock_guard<std::mutex> g(activeMu_);
                notifs_.emplace_back(agent_, req->notif);
            }
            return toNixl(s);
        }
        return progress(*req);
    }

    nixl_status_t
    releaseReqH(nixlBackendReqH *handle) const override {
        auto *req = static_cast<OcReq *>(handle);
        {
            std::lock_guard<std::mutex> g(activeMu_);
            active_.erase(req);
        }
        if (req->saver.joinable()) req->saver.join();
        if (req->transfer) objectcache_transfer_release(req->transfer); // waits for copies
        if (req->region) objectcache_deregister_memory(engine_, req->region);
        delete req;
        return NIXL_SUCCESS;
    }

    nixl_status_t
    getNotifs(notif_list_t &list) override {
        std::vector<OcReq *> reqs;
        {
            std::lock_guard<std::mutex> g(activeMu_);
            reqs.assign(active_.begin(), active_.end());
        }
        for (auto *r : reqs) {
            std::lock_guard<std::mutex> l(r->mu);
            progress(*r);
        }
        std::lock_guard<std::mutex> g(activeMu_);
        for (auto &n : notifs_) list.push_back(n);
        notifs_.clear();
        return NIXL_SUCCESS;
    }

private:
    bool
    chunkHash(const nixlBlobDesc &d, std::vector<uint8_t> &h) const {
        if (!d.metaInfo.empty()) return parseHex(d.metaInfo, h);
        h.resize(8);
        for (int i = 0; i < 8; i++) h[i] = static_cast<uint8_t>(d.devId >> (8 * i));
        return true;
    }

    bool
    coversWholeChunks(const OcReq &req) const {
        std::vector<std::vector<int>> cover(req.hashes.size(), std::vector<int>(g_.layers, 0));
        for (auto &p : req.pieces)
            for (uint32_t l = p.firstLayer; l < p.lastLayer; l++) cover[p.chunk][l]++;
        for (auto &c : cover)
            for (int x : c)
                if (x != 1) return false;
        return true;
    }

    // Polls a load: copies out every piece whose layers are ready, queues notifications.
    // Called with req.mu held.
    nixl_status_t
    progress(OcReq &req) const {
        if (!req.transfer) return NIXL_ERR_NOT_POSTED;
        const size_t perLayer = req.hashes.size() * slice_;
        nixl_status_t failed = NIXL_SUCCESS;
        std::vector<std::pair<std::string, std::string>> out;
        for (uint32_t l = 0; l < g_.layers; l++) {
            if (req.layerState[l] != 0) continue;
            objectcache_status s = objectcache_transfer_poll_layer(req.transfer, l);
            if (s == OBJECTCACHE_OK) {
                req.layerState[l] = 1;
            } else if (s != OBJECTCACHE_PENDING) {
                req.layerState[l] = -1;
                logError("layer " + std::to_string(l), s);
                failed = toNixl(s);
            }
        }
        bool all = true;
        for (auto &p : req.pieces) {
            if (p.done) continue;
            bool ready = true;
            for (uint32_t l = p.firstLayer; l < p.lastLayer; l++) {
                if (req.layerState[l] < 0) failed = failed ? failed : NIXL_ERR_BACKEND;
                ready = ready && req.layerState[l] == 1;
            }
            if (!ready) {
                all = false;
                continue;
            }
            for (uint32_t l = p.firstLayer; l < p.lastLayer; l++)
                std::memcpy(p.local + (l - p.firstLayer) * slice_,
                            &req.staging[l * perLayer + p.chunk * slice_], slice_);
            p.done = true;
        }
        if (req.hasNotif && req.layerNotifs) {
            for (uint32_t l = 0; l < g_.layers; l++) {
                if (req.layerState[l] == 1 && !req.layerNotified[l]) {
                    // Layer l of every piece is in the caller's memory once its pieces are
                    // done; pieces spanning several layers complete with their last layer.
                    bool copied = true;
                    for (auto &p : req.pieces)
                        if (l >= p.firstLayer && l < p.lastLayer && !p.done) copied = false;
                    if (!copied) continue;
                    req.layerNotified[l] = true;
                    out.emplace_back(agent_, req.notif + ":layer:" + std::to_string(l));
                }
            }
        }
        if (failed != NIXL_SUCCESS) return failed;
        if (all && req.hasNotif && !req.completeNotified) {
            req.completeNotified = true;
            out.emplace_back(agent_, req.notif);
        }
        if (!out.empty()) {
            std::lock_guard<std::mutex> g(activeMu_);
            for (auto &n : out) notifs_.push_back(n);
        }
        return all ? NIXL_SUCCESS : NIXL_IN_PROG;
    }

    std::string agent_;
    std::string model_;
    objectcache_engine *engine_ = nullptr;
    objectcache_geometry g_{};
    uint64_t slice_ = 0;
    mutable std::mutex activeMu_;
    mutable std::set<OcReq *> active_;
    mutable notif_list_t notifs_;
};

nixlBackendEngine *
createEngine(const nixlBackendInitParams *init) {
    try {
        return new nixlObjectCacheEngine(init);
    }
    catch (const std::exception &e) {
        std::fprintf(stderr, "objectcache-nixl: cannot create the engine: %s\n", e.what());
        return nullptr;
    }
}

void
destroyEngine(nixlBackendEngine *e) {
    delete e;
}

const char *
pluginName() {
    return kName;
}

const char *
pluginVersion() {
    return kVersion;
}

nixl_b_params_t
backendOptions() {
    nixl_b_params_t p;
    for (const char *k : kEngineKeys) p[k] = "";
    for (const char *k : kGeometryKeys) p[k] = "";
    p["dtype"] = "bf16";
    p["tokens_per_chunk"] = "256";
    p["tp_rank"] = "0";
    p["tp_world"] = "1";
    return p;
}

nixl_mem_list_t
backendMems() {
    return {DRAM_SEG, OBJ_SEG};
}

nixlBackendPlugin plugin = {NIXL_PLUGIN_API_VERSION, createEngine, destroyEngine, pluginName,
                            pluginVersion, backendOptions, backendMems};

} // namespace

extern "C" NIXL_PLUGIN_EXPORT nixlBackendPlugin *
nixl_plugin_init() {
    return &plugin;
}

extern "C" NIXL_PLUGIN_EXPORT void
nixl_plugin_fini() {}

/*
 * Paged KV through the C ABI, as an inference engine that keeps KV in fixed-size blocks uses
 * it (vLLM): one KV buffer registered once, every (layer, block) one contiguous run, one
 * request's blocks scattered through it. Saves from one request's blocks
 * (objectcache_save_paged), loads into another request's blocks (objectcache_load_paged),
 * compares every byte and checks that no other block was touched; then the engine's layout
 * in the key (another layout of equal byte size misses), the earlier geometry size, a
 * per-chunk miss, and every refused argument.
 *
 * Usage: paged STORE_URL
 * Prints one line per failed check and, at the end, "c_paged: N passed, M failed".
 * Compiled and run by tests/integration/c_abi.rs (embedded store, and the ObjectCache server).
 */
#include "objectcache.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define LAYERS 4
#define KV_HEADS 2
#define HEAD_DIM 8
#define BLOCK 16             /* tokens per engine block */
#define CHUNK 32             /* tokens per chunk: 2 blocks */
#define BLOCKS_PER_CHUNK (CHUNK / BLOCK)
#define NUM_BLOCKS 24        /* blocks per layer in the KV buffer */
#define CHUNKS 3
#define NB (CHUNKS * BLOCKS_PER_CHUNK)
#define HASH_LEN 32
/* bytes of one (layer, block): block x 2 (K, V) x heads x dim x 2 (bf16) */
#define BLOCK_BYTES ((size_t)BLOCK * 2 * KV_HEADS * HEAD_DIM * 2)
#define LAYER_BYTES ((size_t)NUM_BLOCKS * BLOCK_BYTES)
#define KV_BYTES ((size_t)LAYERS * LAYER_BYTES)
#define SENTINEL 0x5A

static objectcache_geometry geom(const char *layout, uint32_t block_size) {
    objectcache_geometry g = bf16_geometry(LAYERS, KV_HEADS, HEAD_DIM, CHUNK, "test/c-paged");
    g.layout = layout;
    g.block_size = block_size;
    return g;
}

static unsigned char *block_at(unsigned char *kv, int layer, int block) {
    return kv + (size_t)layer * LAYER_BYTES + (size_t)block * BLOCK_BYTES;
}

/* One range per block of `ids` in every layer, layer-major. */
static void block_ranges(unsigned char *kv, const int *ids, int n, objectcache_range *out) {
    for (int l = 0; l < LAYERS; l++)
        for (int i = 0; i < n; i++) {
            out[l * n + i].addr = block_at(kv, l, ids[i]);
            out[l * n + i].len = BLOCK_BYTES;
        }
}

static objectcache_paged_load_params paged_params(const objectcache_geometry *g,
                                                  const uint8_t *hashes, size_t n_chunks,
                                                  const objectcache_range *r,
                                                  size_t per_layer) {
    objectcache_paged_load_params p;
    ABI_INIT(p);
    p.request_id = 17;
    p.geometry = g;
    p.hashes = hashes;
    p.hash_len = HASH_LEN;
    p.n_chunks = n_chunks;
    p.ranges = r;
    p.ranges_per_layer = per_layer;
    p.n_layers = LAYERS;
    return p;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s STORE_URL\n", argv[0]);
        return 2;
    }
    CHECK(objectcache_struct_size("objectcache_range") == sizeof(objectcache_range),
          "range size");
    CHECK(objectcache_struct_size("objectcache_paged_load_params") ==
              sizeof(objectcache_paged_load_params),
          "paged params size");
    CHECK(objectcache_struct_size("objectcache_geometry") == sizeof(objectcache_geometry),
          "geometry size");

    const char *keys[] = {"store", "namespace", "load_timeout_ms", "lookup_cache_ttl_ms"};
    const char *vals[] = {argv[1], "capi-paged", "60000", "0"};
    objectcache_engine *e = NULL;
    EXPECT(objectcache_engine_create(OBJECTCACHE_ABI_VERSION, keys, vals, 4, &e), OBJECTCACHE_OK);
    if (!e) return 1;

    objectcache_geometry g = geom("test/lbhnc", BLOCK);
    uint64_t slice = 0;
    EXPECT(objectcache_slice_bytes(&g, &slice), OBJECTCACHE_OK);
    CHECK(slice == BLOCKS_PER_CHUNK * BLOCK_BYTES, "slice %llu", (unsigned long long)slice);

    /* Hashes of CHUNKS chunks of a prompt. */
    objectcache_hash_params hp = {sizeof hp, CHUNK, "0", NULL};
    uint32_t tokens[CHUNKS * CHUNK];
    for (int i = 0; i < CHUNKS * CHUNK; i++) tokens[i] = 1000 + (uint32_t)i * 7;
    uint8_t hashes[CHUNKS * HASH_LEN];
    size_t n_chunks = 0;
    EXPECT(objectcache_chunk_hashes(&hp, tokens, CHUNKS * CHUNK, hashes, sizeof hashes, &n_chunks),
           OBJECTCACHE_OK);
    CHECK(n_chunks == CHUNKS, "%zu chunks", n_chunks);

    /* ---- Save request A's blocks from the engine's KV buffer ---- */
    unsigned char *src = malloc(KV_BYTES);
    for (size_t i = 0; i < KV_BYTES; i++) src[i] = (unsigned char)(i * 131 + (i >> 11) * 7 + 3);
    const int a_ids[NB] = {7, 2, 19, 11, 0, 14};
    objectcache_range sr[LAYERS * NB];
    block_ranges(src, a_ids, NB, sr);
    objectcache_save_report rep;
    ABI_INIT(rep);
    EXPECT(objectcache_save_paged(e, &g, hashes, HASH_LEN, CHUNKS, sr, NB, LAYERS, &rep),
           OBJECTCACHE_OK);
    CHECK(rep.written + rep.already_present == CHUNKS, "written %llu present %llu",
          (unsigned long long)rep.written, (unsigned long long)rep.already_present);
    size_t hit = 0;
    EXPECT(objectcache_lookup(e, &g, hashes, HASH_LEN, CHUNKS, &hit), OBJECTCACHE_OK);
    CHECK(hit == CHUNKS, "hit %zu", hit);

    /* ---- The layout is in the key: equal byte size, another meaning, a miss ---- */
    objectcache_geometry other = geom("test/flash", BLOCK);
    EXPECT(objectcache_lookup(e, &other, hashes, HASH_LEN, CHUNKS, &hit), OBJECTCACHE_OK);
    CHECK(hit == 0, "another layout family hit %zu", hit);
    other = geom("test/lbhnc", BLOCK / 2);
    EXPECT(objectcache_lookup(e, &other, hashes, HASH_LEN, CHUNKS, &hit), OBJECTCACHE_OK);
    CHECK(hit == 0, "another block size hit %zu", hit);
    other = geom(NULL, 0);
    EXPECT(objectcache_lookup(e, &other, hashes, HASH_LEN, CHUNKS, &hit), OBJECTCACHE_OK);
    CHECK(hit == 0, "no layout hit %zu", hit);
    /* A caller built before the layout fields (the earlier struct_size): no layout, a miss. */
    other = geom("ignored", 999);
    other.struct_size = (uint32_t)offsetof(objectcache_geometry, layout);
    EXPECT(objectcache_slice_bytes(&other, &slice), OBJECTCACHE_OK);
    CHECK(slice == BLOCKS_PER_CHUNK * BLOCK_BYTES, "old-size slice %llu",
          (unsigned long long)slice);
    EXPECT(objectcache_lookup(e, &other, hashes, HASH_LEN, CHUNKS, &hit), OBJECTCACHE_OK);
    CHECK(hit == 0, "old-size geometry hit %zu", hit);

    /* Bad layouts are refused by name. */
    other = geom("bad name", BLOCK);
    EXPECT_MSG(objectcache_slice_bytes(&other, &slice), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "layout name");
    other = geom("test/lbhnc", 24);
    EXPECT_MSG(objectcache_slice_bytes(&other, &slice), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "do not divide tokens_per_chunk");
    other = geom(NULL, BLOCK);
    EXPECT_MSG(objectcache_slice_bytes(&other, &slice), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "geometry->layout is NULL");
    other = geom("test/lbhnc", BLOCK);
    other._reserved = 1;
    EXPECT_MSG(objectcache_slice_bytes(&other, &slice), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "_reserved");
    other.struct_size = sizeof other + 8;
    EXPECT_MSG(objectcache_slice_bytes(&other, &slice), OBJECTCACHE_ERR_ABI_MISMATCH,
               "struct_size");

    /* ---- Load into request B's blocks of another KV buffer, registered once ---- */
    unsigned char *dst = malloc(KV_BYTES);
    memset(dst, SENTINEL, KV_BYTES);
    objectcache_region *region = NULL;
    EXPECT(objectcache_register_memory(e, dst, KV_BYTES, OBJECTCACHE_MEM_HOST, 0, &region),
           OBJECTCACHE_OK);
    const int b_ids[NB] = {3, 22, 9, 16, 5, 1};
    objectcache_range dr[LAYERS * NB];
    block_ranges(dst, b_ids, NB, dr);
    objectcache_paged_load_params p = paged_params(&g, hashes, CHUNKS, dr, NB);
    objectcache_transfer *t = NULL;
    EXPECT(objectcache_load_paged(e, &p, &t), OBJECTCACHE_OK);
    for (int l = 0; l < LAYERS; l++) {
        EXPECT(objectcache_transfer_wait_layer(t, (uint32_t)l, 30000), OBJECTCACHE_OK);
        /* Layer l is in place: compare it while later layers may still arrive. */
        for (int i = 0; i < NB; i++)
            CHECK(memcmp(block_at(dst, l, b_ids[i]), block_at(src, l, a_ids[i]), BLOCK_BYTES) == 0,
                  "layer %d block %d (engine block %d) differs", l, i, b_ids[i]);
    }
    EXPECT(objectcache_transfer_wait_all(t, 0), OBJECTCACHE_OK);
    uint8_t cs[CHUNKS];
    size_t ncs = 0;
    EXPECT(objectcache_transfer_chunk_status(t, cs, sizeof cs, &ncs), OBJECTCACHE_OK);
    CHECK(ncs == CHUNKS, "chunk status count %zu", ncs);
    for (size_t c = 0; c < ncs; c++)
        CHECK(cs[c] == OBJECTCACHE_CHUNK_OK, "chunk %zu status %u", c, cs[c]);
    objectcache_transfer_stats st;
    ABI_INIT(st);
    EXPECT(objectcache_transfer_stats_get(t, &st), OBJECTCACHE_OK);
    CHECK(st.bytes == (uint64_t)LAYERS * CHUNKS * slice && st.layers_ready == LAYERS &&
              st.request_id == 17,
          "stats bytes %llu ready %u", (unsigned long long)st.bytes, st.layers_ready);
    /* The region is in use until the transfer is released. */
    EXPECT(objectcache_deregister_memory(e, region), OBJECTCACHE_ERR_BUSY);
    EXPECT(objectcache_transfer_release(t), OBJECTCACHE_OK);
    /* Nothing but B's blocks was written. */
    size_t touched = 0;
    for (int l = 0; l < LAYERS; l++)
        for (int b = 0; b < NUM_BLOCKS; b++) {
            int loaded = 0;
            for (int i = 0; i < NB; i++) loaded |= b_ids[i] == b;
            if (loaded) continue;
            const unsigned char *blk = block_at(dst, l, b);
            for (size_t i = 0; i < BLOCK_BYTES; i++) touched += blk[i] != SENTINEL;
        }
    CHECK(touched == 0, "%zu bytes outside the loaded blocks were written", touched);

    /* ---- A chunk that is not stored: every layer is a miss naming it ---- */
    uint8_t holey[CHUNKS * HASH_LEN];
    memcpy(holey, hashes, sizeof holey);
    holey[HASH_LEN + 5] ^= 0xFF; /* chunk 1 unknown */
    p = paged_params(&g, holey, CHUNKS, dr, NB);
    EXPECT(objectcache_load_paged(e, &p, &t), OBJECTCACHE_OK);
    for (int l = 0; l < LAYERS; l++)
        EXPECT(objectcache_transfer_wait_layer(t, (uint32_t)l, 30000),
               OBJECTCACHE_ERR_LAYER_MISSING);
    EXPECT(objectcache_transfer_chunk_status(t, cs, sizeof cs, &ncs), OBJECTCACHE_OK);
    CHECK(cs[1] == OBJECTCACHE_CHUNK_MISSING, "chunk 1 status %u", cs[1]);
    EXPECT(objectcache_transfer_release(t), OBJECTCACHE_OK);

    /* ---- Refused loads, each named ---- */
    objectcache_range bad[LAYERS * NB];
    memcpy(bad, dr, sizeof bad);
    bad[2 * NB + 0] = dr[1]; /* layer 2 range 0 is layer 0 range 1's block */
    p = paged_params(&g, hashes, CHUNKS, bad, NB);
    t = NULL;
    EXPECT_MSG(objectcache_load_paged(e, &p, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT, "overlap");
    CHECK(strstr(objectcache_last_error(), "layer 0 range 1") &&
              strstr(objectcache_last_error(), "layer 2 range 0"),
          "overlap names both ranges");
    CHECK(t == NULL, "transfer written on error");
    memcpy(bad, dr, sizeof bad);
    bad[5].addr = dst + 3 * BLOCK_BYTES + 100; /* straddles block 3 (layer 0 range 0) */
    EXPECT_MSG(objectcache_load_paged(e, &p, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "layer 0 range 5");
    memcpy(bad, dr, sizeof bad);
    bad[NB + 3].addr = src; /* not registered */
    EXPECT_MSG(objectcache_load_paged(e, &p, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "not inside memory registered");
    memcpy(bad, dr, sizeof bad);
    bad[LAYERS * NB - 1].addr = dst + KV_BYTES - BLOCK_BYTES / 2; /* runs past the region */
    EXPECT_MSG(objectcache_load_paged(e, &p, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "layer 3 range 5");
    memcpy(bad, dr, sizeof bad);
    bad[NB + 2].len = BLOCK_BYTES - 1;
    EXPECT_MSG(objectcache_load_paged(e, &p, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "ranges of layer 1 add up to");
    memcpy(bad, dr, sizeof bad);
    bad[3].len = 0;
    EXPECT_MSG(objectcache_load_paged(e, &p, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT, "len is 0");
    memcpy(bad, dr, sizeof bad);
    bad[4].addr = NULL;
    EXPECT_MSG(objectcache_load_paged(e, &p, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "addr is NULL");
    p = paged_params(&g, hashes, CHUNKS, dr, NB);
    p.n_layers = LAYERS - 1;
    EXPECT_MSG(objectcache_load_paged(e, &p, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT, "n_layers");
    p = paged_params(&g, hashes, CHUNKS, dr, 0);
    EXPECT_MSG(objectcache_load_paged(e, &p, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT,
               "ranges_per_layer is 0");
    p = paged_params(&g, hashes, CHUNKS, NULL, NB);
    EXPECT_MSG(objectcache_load_paged(e, &p, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT, "ranges");
    p = paged_params(&g, hashes, CHUNKS, dr, NB);
    p.struct_size = sizeof p - 8;
    EXPECT_MSG(objectcache_load_paged(e, &p, &t), OBJECTCACHE_ERR_ABI_MISMATCH, "struct_size");
    p = paged_params(&g, hashes, 0, dr, NB);
    EXPECT_MSG(objectcache_load_paged(e, &p, &t), OBJECTCACHE_ERR_INVALID_ARGUMENT, "n_chunks");
    p = paged_params(&g, hashes, CHUNKS, dr, NB);
    EXPECT(objectcache_load_paged(e, &p, NULL), OBJECTCACHE_ERR_INVALID_ARGUMENT);
    EXPECT(objectcache_load_paged(NULL, &p, &t), OBJECTCACHE_ERR_INVALID_HANDLE);
    CHECK(t == NULL, "transfer written on error");

    /* ---- Refused saves ---- */
    memcpy(bad, sr, sizeof bad);
    bad[2 * NB + 1].len = BLOCK_BYTES + 1;
    EXPECT_MSG(objectcache_save_paged(e, &g, hashes, HASH_LEN, CHUNKS, bad, NB, LAYERS, NULL),
               OBJECTCACHE_ERR_INVALID_ARGUMENT, "source ranges of layer 2 add up to");
    EXPECT_MSG(objectcache_save_paged(e, &g, hashes, HASH_LEN, CHUNKS, sr, NB, LAYERS - 1, NULL),
               OBJECTCACHE_ERR_INVALID_ARGUMENT, "n_layers");
    EXPECT_MSG(objectcache_save_paged(e, &g, hashes, HASH_LEN, 0, sr, NB, LAYERS, NULL),
               OBJECTCACHE_ERR_INVALID_ARGUMENT, "n_chunks");
    EXPECT(objectcache_save_paged(e, &g, hashes, HASH_LEN, CHUNKS, NULL, NB, LAYERS, NULL),
           OBJECTCACHE_ERR_INVALID_ARGUMENT);
    /* A save whose sources overlap is fine (they are only read): the same block twice. */
    objectcache_range twice[LAYERS * 2];
    for (int l = 0; l < LAYERS; l++) {
        twice[l * 2] = sr[l * NB];
        twice[l * 2 + 1] = sr[l * NB];
    }
    uint8_t fresh[HASH_LEN];
    memset(fresh, 0x42, sizeof fresh);
    ABI_INIT(rep);
    EXPECT(objectcache_save_paged(e, &g, fresh, HASH_LEN, 1, twice, 2, LAYERS, &rep),
           OBJECTCACHE_OK);
    CHECK(rep.written + rep.already_present == 1, "one chunk saved");

    /* ---- Clean up ---- */
    EXPECT(objectcache_deregister_memory(e, region), OBJECTCACHE_OK);
    EXPECT(objectcache_engine_destroy(e), OBJECTCACHE_OK);
    free(src);
    free(dst);
    printf("c_paged: %d passed, %d failed\n", passed, failed);
    return failed != 0;
}

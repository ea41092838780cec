"""Helpers shared by the package tests: deterministic KV bytes, stored-object files."""

import os
import random

import objectcache as oc


def geometry(model="pytest/m", layers=3, tokens_per_chunk=32, **kw):
    """A small model: 3 layers, 4 KV heads of dim 16, bf16 (slice: 4 KiB at 32 tokens)."""
    return oc.Geometry(model, layers=layers, kv_heads=4, head_dim=16, dtype="bf16",
                       tokens_per_chunk=tokens_per_chunk, **kw)


def layer_bytes(g, n_chunks, layer, seed):
    """Deterministic KV bytes of one layer of n_chunks chunks."""
    r = random.Random(seed * 1000 + layer)
    return r.randbytes(n_chunks * g.slice_bytes)


def kv(g, n_chunks, seed):
    """Per-layer KV bytes of a prefix."""
    return [layer_bytes(g, n_chunks, l, seed) for l in range(g.layers)]


def tokens(n, seed):
    r = random.Random(seed)
    return [r.randrange(1, 50000) for _ in range(n)]


def data_objects(root):
    """Paths of the chunk data objects (`.../kv/<hash>`) under a directory store."""
    out = []
    for d, _, files in os.walk(root):
        if os.path.basename(d) == "kv":
            out += [os.path.join(d, f) for f in files]
    return sorted(out)


def flip_byte(path, offset):
    """Flips one byte of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def split_layers(buf, g, n_chunks):
    """Per-layer memoryviews of a layer-major buffer of n_chunks chunks."""
    per = n_chunks * g.slice_bytes
    mv = memoryview(buf)
    return [mv[l * per:(l + 1) * per] for l in range(g.layers)]

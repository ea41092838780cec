"""ObjectCache for Python: a thin layer over ObjectCache's C ABI (``objectcache.h``).

ObjectCache keeps the KV cache of prompt prefixes in S3-compatible object storage (or on a
local disk) and loads it back layer by layer, in the order prefill consumes it. This package
binds the C library bundled with it (``libobjectcache.so``) through ``ctypes``; it needs
nothing else at run time. Every call maps to one C function; errors are exceptions that carry
the C ABI's error name and message (:class:`ObjectCacheError` and its subclasses).

Example::

    import objectcache as oc

    eng = oc.Engine(store="/tmp/kv", namespace="demo")
    g = oc.Geometry("demo/m", layers=2, kv_heads=4, head_dim=16, tokens_per_chunk=32)
    hashes = oc.chunk_hashes(range(64), block_size=32)
    kv = [bytes(range(256)) * (2 * g.slice_bytes // 256) for _ in range(g.layers)]
    eng.save(g, hashes, kv)
    dst = bytearray(g.layers * 2 * g.slice_bytes)
    region = eng.register(dst)
    per_layer = 2 * g.slice_bytes
    views = [memoryview(dst)[l * per_layer:(l + 1) * per_layer] for l in range(g.layers)]
    with eng.load(g, hashes[:eng.lookup(g, hashes)], views) as t:
        for layer in range(g.layers):
            t.wait_layer(layer)          # layer is verified KV now
    region.close()

The vLLM KV connector is :mod:`objectcache.vllm` (imported only when used; it needs vLLM).
"""

from ._core import *  # noqa: F401,F403
from ._core import __all__ as _core_all
from ._ffi import ABI_VERSION, library_path

#: Version of this package (equal to the library's version it is built with).
__version__ = "0.1.0"

__all__ = list(_core_all) + ["ABI_VERSION", "library_path", "__version__"]

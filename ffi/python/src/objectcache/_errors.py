"""The C ABI's status codes as exceptions (one class per code, the layer misses under
:class:`LayerMissError`), and the library's version."""

from . import _ffi
from ._ffi import lib


# ---- Errors ----------------------------------------------------------------------------------


class ObjectCacheError(Exception):
    """A failed C ABI call.

    Attributes:
        code: the status code (an ``OBJECTCACHE_ERR_*`` integer).
        name: its C name, e.g. ``"OBJECTCACHE_ERR_CONFIG"``.
        message: ``objectcache_last_error()`` of the failing call: the function, the argument,
            the sizes, the key or layer concerned.
    """

    def __init__(self, code, name, message):
        super().__init__(f"{name}: {message}")
        self.code = code
        self.name = name
        self.message = message


class InvalidArgumentError(ObjectCacheError, ValueError):
    """``OBJECTCACHE_ERR_INVALID_ARGUMENT``: a bad pointer, size, count or value."""


class AbiMismatchError(ObjectCacheError):
    """``OBJECTCACHE_ERR_ABI_MISMATCH``: this package and the library disagree on the ABI."""


class InvalidHandleError(ObjectCacheError):
    """``OBJECTCACHE_ERR_INVALID_HANDLE``: a destroyed, released or wrong-kind handle."""


class UnsupportedError(ObjectCacheError):
    """``OBJECTCACHE_ERR_UNSUPPORTED``: not in this build (e.g. device memory without CUDA)."""


class BusyError(ObjectCacheError):
    """``OBJECTCACHE_ERR_BUSY``: an engine with live transfers, a region in use."""


class BufferTooSmallError(ObjectCacheError):
    """``OBJECTCACHE_ERR_BUFFER_TOO_SMALL``."""


class ConfigError(ObjectCacheError, ValueError):
    """``OBJECTCACHE_ERR_CONFIG``: an unknown setting or a value that does not parse."""


class FormatError(ObjectCacheError):
    """``OBJECTCACHE_ERR_FORMAT``: bytes that are not a valid KV object."""


class NotFoundError(ObjectCacheError):
    """``OBJECTCACHE_ERR_NOT_FOUND``: the store has no such object."""


class StoreError(ObjectCacheError):
    """``OBJECTCACHE_ERR_STORE``: any other object-store failure."""


class IoError(ObjectCacheError):
    """``OBJECTCACHE_ERR_IO``: an operating-system I/O failure outside the store."""


class InternalError(ObjectCacheError):
    """``OBJECTCACHE_ERR_INTERNAL``: a caught panic inside the library."""


class LayerMissError(ObjectCacheError):
    """A layer miss (codes 20 to 26): the layer's destination holds no KV; recompute it."""


class LayerMissingError(LayerMissError):
    """``OBJECTCACHE_ERR_LAYER_MISSING``: a chunk object is missing."""


class LayerChecksumError(LayerMissError):
    """``OBJECTCACHE_ERR_LAYER_CHECKSUM``: a slice failed its CRC32C (corrupt object)."""


class LayerGeometryError(LayerMissError):
    """``OBJECTCACHE_ERR_LAYER_GEOMETRY``: an object of another geometry, layout or format."""


class LayerStorageError(LayerMissError):
    """``OBJECTCACHE_ERR_LAYER_STORAGE``: storage or transport failed."""


class LayerTimeoutError(LayerMissError):
    """``OBJECTCACHE_ERR_LAYER_TIMEOUT``: the engine's ``load_timeout_ms`` passed."""


class LayerCancelledError(LayerMissError):
    """``OBJECTCACHE_ERR_CANCELLED``: the transfer was cancelled."""


class LayerDeviceError(LayerMissError):
    """``OBJECTCACHE_ERR_LAYER_DEVICE``: the copy to device memory failed (CUDA builds)."""


_ERROR_CLASSES = {
    2: InvalidArgumentError,
    3: AbiMismatchError,
    4: InvalidHandleError,
    5: UnsupportedError,
    6: BusyError,
    7: BufferTooSmallError,
    8: ConfigError,
    9: FormatError,
    10: NotFoundError,
    11: StoreError,
    12: IoError,
    13: InternalError,
    20: LayerMissingError,
    21: LayerChecksumError,
    22: LayerGeometryError,
    23: LayerStorageError,
    24: LayerTimeoutError,
    25: LayerCancelledError,
    26: LayerDeviceError,
}


def status_name(code):
    """The C name of a status code (``objectcache_status_name``), e.g.
    ``"OBJECTCACHE_ERR_LAYER_CHECKSUM"``; ``"unknown status"`` for others."""
    return lib.objectcache_status_name(code).decode()


def _error(code, message=None):
    if message is None:
        message = lib.objectcache_last_error().decode(errors="replace")
    cls = _ERROR_CLASSES.get(code, ObjectCacheError)
    return cls(code, status_name(code), message)


def _check(code):
    """Raises the error of a failed call; returns OK or PENDING unchanged."""
    if code in (_ffi.OK, _ffi.PENDING):
        return code
    raise _error(code)


def version():
    """The library's version string (``objectcache_version``), e.g. ``"0.1.0"``."""
    return lib.objectcache_version().decode()


def abi_version():
    """The library's C ABI version (``objectcache_abi_version``)."""
    return lib.objectcache_abi_version()

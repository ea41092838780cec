"""The Python package's two copies of what the library defines, checked against it: the type
stub (objectcache/__init__.pyi) ships with the package and names the API it has (the same
public names as ``objectcache.__all__``, and for every function and method of the stub the
same parameters, in order, with the same defaults); and the ctypes views of the C ABI's
structs agree with the library field by field (names and offsets), a disagreement being an
error that names the field."""

import ast
import inspect
import pathlib

import objectcache as oc


def _stub():
    path = pathlib.Path(oc.__file__).with_name("__init__.pyi")
    assert path.exists(), f"the installed package has no type stub at {path}"
    assert path.with_name("py.typed").exists(), "the package is not marked typed (py.typed)"
    return ast.parse(path.read_text())


def _top_names(tree):
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n != "Buffer"}


def _params(fn):
    """(name, default source or None) per parameter of a stub function."""
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    out = list(zip([p.arg for p in pos], defaults))
    if a.vararg:
        out.append(("*" + a.vararg.arg, None))
    out += [(p.arg, None if d is None else ast.unparse(d))
            for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append(("**" + a.kwarg.arg, None))
    return out


def _runtime_params(obj):
    out = []
    for p in inspect.signature(obj).parameters.values():
        name = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        out.append((name, None if p.default is p.empty else repr(p.default)))
    return out


def test_the_stub_names_exactly_the_public_api():
    assert _top_names(_stub()) == set(oc.__all__)


def test_every_stub_signature_matches_the_code():
    checked = 0
    for node in _stub().body:
        if isinstance(node, ast.FunctionDef):
            assert _params(node) == _runtime_params(getattr(oc, node.name)), node.name
            checked += 1
        elif isinstance(node, ast.ClassDef):
            cls = getattr(oc, node.name)
            for fn in node.body:
                if not isinstance(fn, ast.FunctionDef) or any(
                        isinstance(d, ast.Name) and d.id == "property"
                        for d in fn.decorator_list):
                    continue
                assert hasattr(cls, fn.name), f"{node.name}.{fn.name} is not in the code"
                if fn.name in ("__enter__", "__exit__"):
                    continue
                want = _runtime_params(getattr(cls, fn.name))
                assert _params(fn) == want, f"{node.name}.{fn.name}: stub {_params(fn)}, code {want}"
                checked += 1
    assert checked >= 30, checked


def test_every_ctypes_struct_matches_the_library_field_by_field():
    """The package's ctypes views of the ABI structs agree with the library, field by field
    (objectcache_struct_field), and a view that does not is refused naming the field."""
    import ctypes

    from objectcache import _ffi

    for cname, cls in _ffi.STRUCTS.items():
        assert _ffi.struct_mismatch(_ffi.lib, cname, cls) is None, cname
    fields = list(_ffi.Geometry._fields_)

    def view(fs):
        return type("Wrong", (ctypes.Structure,), {"_fields_": fs})

    swapped = fields[:]
    swapped[1], swapped[2] = swapped[2], swapped[1]  # layers <-> kv_heads (both u32)
    why = _ffi.struct_mismatch(_ffi.lib, "objectcache_geometry", view(swapped))
    assert why == "objectcache_geometry field 1 is layers in the library, kv_heads here", why
    renamed = fields[:-1] + [("reserved", fields[-1][1])]
    why = _ffi.struct_mismatch(_ffi.lib, "objectcache_geometry", view(renamed))
    assert "field 11 is _reserved in the library, reserved here" in why, why
    # Without its last u32 the struct keeps its size (tail padding to 8 bytes).
    shorter = view(fields[:-1])
    assert ctypes.sizeof(shorter) == ctypes.sizeof(_ffi.Geometry)
    why = _ffi.struct_mismatch(_ffi.lib, "objectcache_geometry", shorter)
    assert why.startswith("objectcache_geometry._reserved (field 11, offset"), why
    assert why.endswith("is missing here"), why
    grown = view(fields + [("extra", ctypes.c_uint64)])
    why = _ffi.struct_mismatch(_ffi.lib, "objectcache_geometry", grown)
    assert why.startswith("sizeof(objectcache_geometry) is"), why

"""The type stub (objectcache/__init__.pyi) ships with the package and describes the API the
package has: the same public names as ``objectcache.__all__``, and for every function and
method of the stub, the same parameters, in order, with the same defaults, as at run time."""

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

"""Live functions are pickled once and reused only while everything they captured is unchanged."""

import gc
import pickle
import subprocess
import sys
import weakref

import cloudpickle
import pytest

from monarch.runtime.controller import fnblob

pytestmark = pytest.mark.timeout(60)


def notebook(src: str) -> dict:
    """Run `src` as a notebook cell would: its functions live in `__main__` and travel by value."""
    ns = {"__name__": "__main__"}
    exec(compile(src, "<cell>", "exec"), ns)
    return ns


def blob(fn) -> bytes:
    return fnblob.function_blob(fn, lambda: None, lambda obj: cloudpickle.dumps(obj, protocol=5))


def run(b: bytes, *args):
    return pickle.loads(b)(*args)


def test_unchanged_function_is_pickled_once_and_a_rebound_global_is_seen():
    ns = notebook("import torch\nscale = 2\ndef f(x):\n    return torch.tensor(x).mul(scale).item()\n")
    first = blob(ns["f"])
    assert blob(ns["f"]) is first  # nothing changed: the kept pickle
    assert run(first, 3) == 6
    ns["scale"] = 5
    second = blob(ns["f"])
    assert second is not first and run(second, 3) == 15
    ns["scale"] = 5.0  # equal, but another type: pickled again
    assert run(blob(ns["f"]), 3) == 15.0 and blob(ns["f"]) is not second


def test_mutable_globals_are_pickled_at_every_call():
    ns = notebook("seen = [1]\ndef f():\n    return list(seen)\n")
    assert fnblob.fingerprint(ns["f"]) is None
    assert run(blob(ns["f"])) == [1]
    ns["seen"].append(2)  # mutated in place: no identity or value check could see it, so no caching
    assert run(blob(ns["f"])) == [1, 2]


def test_redefined_helper_closure_and_defaults_are_seen():
    ns = notebook(
        "def helper(x):\n    return x + 1\n"
        "def f(x):\n    return helper(x)\n"
        "def make(k):\n    def g(x, y=1):\n        return x * k + y\n    return g\n"
    )
    f = ns["f"]
    assert run(blob(f), 1) == 2
    exec("def helper(x):\n    return x + 100\n", ns)  # a new helper object under the same name
    assert run(blob(f), 1) == 101
    g = ns["make"](3)
    assert run(blob(g), 2) == 7
    g.__defaults__ = (10,)
    assert run(blob(g), 2) == 16
    h = ns["make"](4)  # same code, another closure value
    assert run(blob(h), 2) == 9


def test_recursive_function_fingerprint_does_not_hold_itself():
    ns = notebook("def fact(n):\n    return 1 if n <= 1 else n * fact(n - 1)\n")
    b = blob(ns["fact"])
    assert blob(ns["fact"]) is b and run(b, 5) == 120
    gone = weakref.ref(ns["fact"])
    ns.clear()
    gc.collect()
    assert gone() is None  # the kept pickle and fingerprint did not keep the function alive


def test_submodules_are_still_shipped_when_the_scan_is_remembered():
    """cloudpickle adds `concurrent.futures` to a function that reaches it through `concurrent`;
    with the scan remembered, the second pickle must carry it too."""
    import concurrent.futures  # noqa: F401  (the submodule must be imported here to be found)

    ns = notebook("import concurrent\ndef f():\n    return concurrent.futures.Future.__name__\n")
    cloudpickle.dumps(ns["f"])
    data = cloudpickle.dumps(ns["f"])  # the remembered scan
    code = "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read())())"
    r = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().strip() == "Future"


def test_captured_objects_pickled_by_value_are_never_reused():
    """A bound builtin method (`cfg.get`) carries its dict; a module made in the notebook carries its
    namespace: both change unseen, so such functions are pickled at every call."""
    ns = notebook(
        "import types\ncfg = {'lr': 0.1}\nget = cfg.get\nmod = types.ModuleType('scratch')\nmod.k = 1\n"
        "def f():\n    return get('lr')\n"
        "def g():\n    return mod.k\n"
    )
    assert run(blob(ns["f"])) == 0.1 and run(blob(ns["g"])) == 1
    ns["cfg"]["lr"] = 0.5
    ns["mod"].k = 2
    assert run(blob(ns["f"])) == 0.5 and run(blob(ns["g"])) == 2
    assert fnblob.fingerprint(ns["f"]) is None and fnblob.fingerprint(ns["g"]) is None


def test_a_change_while_pickling_is_not_kept_under_the_old_fingerprint():
    ns = notebook("mode = 1\ndef f():\n    return mode\n")

    def pickle_while_another_thread_changes_mode(obj):
        ns["mode"] = 2
        return cloudpickle.dumps(obj, protocol=5)

    fnblob.function_blob(ns["f"], lambda: None, pickle_while_another_thread_changes_mode)
    ns["mode"] = 1
    assert run(blob(ns["f"])) == 1


def test_fingerprints_do_not_keep_functions_alive_and_deep_values_do_not_fail():
    ns = notebook(
        "def make(n):\n"
        "    def f(x):\n        return x if x <= 0 else g(x - 1)\n"
        "    def g(x):\n        return f(x)\n"
        "    return f\n"
        "deep = ()\n"
        "for _ in range(600):\n    deep = (deep,)\n"
        "def h():\n    return len(deep)\n"
    )
    refs = []
    for i in range(3):
        f = ns["make"](i)
        assert run(blob(f), 2) == 0
        refs.append(weakref.ref(f))
        del f
    gc.collect()
    assert [r() for r in refs] == [None, None, None]  # mutual recursion through a closure: still freed
    assert run(blob(ns["h"])) == 1  # too deep to fingerprint: pickled, not an error

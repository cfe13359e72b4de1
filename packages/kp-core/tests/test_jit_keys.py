"""kp_core.jit_keys: a kernel's Triton cache key does not depend on which kernel was keyed first."""

import importlib.util
import textwrap

import pytest

from kp_core import jit_keys

pytest.importorskip("triton")

# Built with JITFunction directly (not @triton.jit), so the functions have cache keys under TRITON_INTERPRET=1
# too. Two kernels share a helper that reads a global constexpr, through a second helper: the case whose key
# Triton 3.5-3.7 made depend on the order.
SOURCE = textwrap.dedent(
    """
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    ORDER = []  # the functions in the order their keys were first asked for
    SCALE = tl.constexpr(3)


    class Recorded(JITFunction):
        @property
        def cache_key(self):
            if self.fn.__name__ not in ORDER:
                ORDER.append(self.fn.__name__)
            return super().cache_key


    def _scale(x):
        return x * SCALE


    scale = Recorded(_scale)


    def _scale_plus_one(x):
        return scale(x) + 1


    scale_plus_one = Recorded(_scale_plus_one)


    def _first(X, BLOCK: tl.constexpr):
        tl.store(X, scale_plus_one(tl.load(X)))


    first = Recorded(_first)


    def _second(X, BLOCK: tl.constexpr):
        tl.store(X, scale(tl.load(X)) - 1)


    second = Recorded(_second)


    class Namespace:
        pass


    NAMESPACE = Namespace()


    def not_jit(x):
        return x


    # Keying fails: Triton 3.2 and 3.6 look the attribute up (as 3.2 does triton.language's newer functions),
    # 3.6 and 3.9 refuse a plain Python function.
    def _unkeyable(X):
        tl.store(X, not_jit(tl.load(X)) * NAMESPACE.MISSING)


    unkeyable = Recorded(_unkeyable)
    """
)


def _copy(tmp_path, name):
    """A fresh import of SOURCE: new JIT functions, no key computed yet (a new process, as far as keys go)."""
    path = tmp_path / f"{name}.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_kernel_has_one_key_whichever_kernel_was_keyed_first(tmp_path):
    one, other = _copy(tmp_path, "kp_keys_one"), _copy(tmp_path, "kp_keys_other")
    jit_keys.settle(one.second)  # `second` launched first in this "process": `scale` keyed through it
    jit_keys.settle(one.first)
    jit_keys.settle(other.first)  # `first` alone in this one
    assert one.first.cache_key == other.first.cache_key
    assert one.second.cache_key == _settled(_copy(tmp_path, "kp_keys_third"), "second")


def _settled(module, name):
    jit_keys.settle(getattr(module, name))
    return getattr(module, name).cache_key


def test_helpers_are_keyed_before_the_kernels_that_call_them(tmp_path):
    module = _copy(tmp_path, "kp_keys_order")
    jit_keys.settle(module.first)
    assert module.ORDER == ["_scale", "_scale_plus_one", "_first"]
    jit_keys.settle(module.second)
    assert module.ORDER == ["_scale", "_scale_plus_one", "_first", "_second"]


def test_other_callables_are_left_alone():
    jit_keys.settle(len)  # not a JIT function (an interpreted kernel, say): nothing to key
    assert not jit_keys._settled(len)


def test_a_module_settles_its_functions_at_import(tmp_path):
    path = tmp_path / "kp_keys_module.py"
    path.write_text(SOURCE + "\nfrom kp_core import jit_keys\njit_keys.settle_module(globals())\n")
    spec = importlib.util.spec_from_file_location("kp_keys_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # module order: `first` (with its helpers ahead of it), then `second`, whose helper is already keyed; the
    # import survives `unkeyable`, which is left for its launch
    assert module.ORDER == ["_scale", "_scale_plus_one", "_first", "_second", "_unkeyable"]
    assert module.unkeyable.hash is None and module.first.hash is not None


def test_a_kernel_this_triton_cannot_key_is_left_for_its_launch(tmp_path):
    module = _copy(tmp_path, "kp_keys_unkeyable")
    jit_keys.settle(module.unkeyable)  # Triton's keying raises: at a launch, never at import
    assert not jit_keys._settled(module.unkeyable)
    assert module.unkeyable.hash is None  # no placeholder key left behind
    with pytest.raises(Exception, match="MISSING|Unsupported function"):
        module.unkeyable.cache_key  # noqa: B018

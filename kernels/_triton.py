"""Lazy Triton binding for the kernel files: importing `kernels.*` never imports triton.

A kernel is written at module level as a plain function whose body uses the module-global
name `tl`; `lazy_jit` wraps it, and on the first launch imports triton, binds `tl` in the
kernel's module and applies `triton.jit`. Because `triton.jit` runs at that moment,
`TRITON_INTERPRET=1` set any time before the first launch selects the interpreter.

`LazyKernel.launch` also keeps a cheaper launch path on the GPU: Triton's own dispatch binds
and specialises every argument in Python on each call; `launch` keys the compiled kernel by the
few facts Triton specialises on (int value classes, tensor dtype and 16-byte alignment, the
constexprs and launch options) and calls it directly after the first launch.

Runtime ints that change from step to step (tile counts, split counts) are named in
`lazy_jit(do_not_specialize=...)`: Triton would otherwise compile a variant per value class
(== 1, divisible by 16, other), and a compile costs about a second on an H200 in the middle of
serving (the offline throughput run hit ~25 of them before this). Metadata pointers that the
engine slices at any offset (a mixed step's prefill half of seq_lens) are named in
`do_not_specialize_on_alignment` for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Direct launches of compiled kernels (see LazyKernel.launch); the benchmark flips it to time both.
FAST_LAUNCH = True
_MAX_CACHED = 256  # compiled-kernel handles kept per kernel before the table is cleared


def _spec(a: Any) -> Any:
    """What Triton's dispatch specialises an argument on (ints: ==1, %16, 32-bit; tensors: dtype, alignment)."""
    t = type(a)
    if t is int:
        return (a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31))
    if t is float or a is None:
        return None
    data_ptr = getattr(a, "data_ptr", None)
    if data_ptr is None:
        return (t, a)  # anything else: keyed by its value
    return (a.dtype, data_ptr() % 16 == 0)


_KERNELS: list[LazyKernel] = []  # every kernel defined, for kernel_compiles()
_HELPERS: list[Callable] = []  # every lazy_helper function
_JITTED_HELPERS: dict[Callable, Any] = {}  # helper -> its triton.jit function (one per helper)


def lazy_helper(fn: Callable) -> Callable:
    """A device function lazy kernels call, of its module or of another that imports it by name:
    `triton.jit` is applied to it once (its module's `tl` bound) and the jitted function bound under
    its name, in its own module and the kernel's, when the first kernel that names it is jitted."""
    _HELPERS.append(fn)
    return fn


def _jit_helper(fn: Callable, triton: Any, tl: Any) -> Any:
    jitted = _JITTED_HELPERS.get(fn)
    if jitted is None:
        home = fn.__globals__
        home["tl"] = tl
        jitted = _JITTED_HELPERS[fn] = triton.jit(fn)
        if home.get(fn.__name__) is fn:
            home[fn.__name__] = jitted
    return jitted


def _spec_unspecialised(a: Any) -> Any:
    """The key of a `do_not_specialize` int: only its width."""
    return -(1 << 31) <= a < (1 << 31) if type(a) is int else _spec(a)


def _spec_any_alignment(a: Any) -> Any:
    """The key of a `do_not_specialize_on_alignment` tensor: only its dtype."""
    return (a.dtype,) if hasattr(a, "data_ptr") else _spec(a)


class LazyKernel:
    """A Triton kernel jitted at its first launch; `kernel[grid](...)` as with `triton.jit`."""

    def __init__(self, fn: Callable, do_not_specialize: tuple[str, ...] = (),
                 do_not_specialize_on_alignment: tuple[str, ...] = ()) -> None:
        self.fn = fn
        self.do_not_specialize = do_not_specialize
        self.do_not_specialize_on_alignment = do_not_specialize_on_alignment
        names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
        unknown = (set(do_not_specialize) | set(do_not_specialize_on_alignment)) - set(names)
        if unknown:
            raise ValueError(f"{fn.__name__}: do_not_specialize names no argument {sorted(unknown)}")
        # per positional argument: the function that keys its specialisation
        self._spec_fns = tuple(
            _spec_unspecialised if n in do_not_specialize
            else _spec_any_alignment if n in do_not_specialize_on_alignment else _spec
            for n in names
        )
        self._custom_spec = bool(do_not_specialize or do_not_specialize_on_alignment)
        self._jitted: Any = None
        self._compiled: dict = {}  # specialisation key -> (compiled kernel, constexpr values in order)
        self._orders: set = set()  # constexpr name orders checked against the signature
        self.num_compiles = 0  # specialisations launched through Triton's dispatch (a compile or a cache load)
        _KERNELS.append(self)

    def jitted(self) -> Any:
        """Return the `triton.jit` function (jitting it on first use)."""
        if self._jitted is None:
            import triton
            import triton.language as tl

            g = self.fn.__globals__
            g["tl"] = tl
            for h in _HELPERS:
                if g.get(h.__name__) is h:  # named here, not bound to its jitted function yet
                    g[h.__name__] = _jit_helper(h, triton, tl)
            self._jitted = triton.jit(
                self.fn, do_not_specialize=list(self.do_not_specialize) or None,
                do_not_specialize_on_alignment=list(self.do_not_specialize_on_alignment) or None,
            )
        return self._jitted

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]

    def _check_order(self, n_args: int, consts: dict) -> None:
        """Refuse constexprs in another order than the signature's (the direct launch passes them by
        position): since 6f1a740 decode attention's went unnoticed through Triton's slow dispatch."""
        order = tuple(consts)
        if order in self._orders:
            return
        names = self.fn.__code__.co_varnames[n_args: self.fn.__code__.co_argcount]
        if names != order:
            raise ValueError(f"{self.fn.__name__}: constexprs given as {order}, the signature has {names}: "
                             "the direct launch passes them by position")
        self._orders.add(order)

    def launch(self, grid: tuple, args: tuple, consts: dict, num_warps: int, num_stages: int, fast: bool,
               maxnreg: int | None = None) -> None:
        """`self[grid](*args, **consts, num_warps=..., num_stages=...)`, the runtime args first.
        maxnreg: a register cap per thread (Triton's option; more programs resident per SM).

        fast (the caller's choice: on a CUDA device, not under the interpreter): after the first
        launch of a specialisation, launch the compiled kernel directly, skipping Triton's per-call
        binding (the compiled kernel takes every argument in signature order, constexprs included).
        consts must be in the kernel's signature order, after the runtime args.
        """
        global FAST_LAUNCH
        opts = {"num_warps": num_warps, "num_stages": num_stages}
        if maxnreg is not None:
            opts["maxnreg"] = maxnreg
        if not (fast and FAST_LAUNCH):
            self._check_order(len(args), consts)
            self.jitted()[grid](*args, **consts, **opts)
            return
        if self._custom_spec:
            spec = tuple(f(a) for f, a in zip(self._spec_fns, args))
        else:
            spec = tuple(map(_spec, args))
        key = (spec, *consts.values(), num_warps, num_stages, maxnreg, args[0].device.index)
        hit = self._compiled.get(key)
        if hit is not None:
            try:
                # a compiled kernel's launcher reads grid[0], grid[1] and grid[2]: pad to three axes
                hit[0][grid if len(grid) == 3 else (*grid, 1, 1)[:3]](*args, *hit[1])
            except (TypeError, IndexError):  # a Triton whose compiled kernels differ: its own dispatch from now on
                FAST_LAUNCH = False
                self._compiled.clear()
                self.jitted()[grid](*args, **consts, **opts)
            return
        self._check_order(len(args), consts)  # a hit was checked when it was stored
        compiled = self.jitted()[grid](*args, **consts, **opts)
        self.num_compiles += 1
        names = list(self.jitted().arg_names)
        if compiled is None or names[len(args):] != list(consts):
            return  # not a compiled kernel (interpreter) or an unexpected signature: keep Triton's path
        if len(self._compiled) >= _MAX_CACHED:
            self._compiled.clear()
        self._compiled[key] = (compiled, tuple(consts.values()))


def lazy_jit(fn: Callable | None = None, *, do_not_specialize: tuple[str, ...] = (),
             do_not_specialize_on_alignment: tuple[str, ...] = ()) -> Any:
    """Decorator: `triton.jit` deferred to the first launch (see the module docstring).

    `@lazy_jit` or `@lazy_jit(do_not_specialize=("n",), do_not_specialize_on_alignment=("p",))`:
    the named int arguments are not specialised on their value, the named pointers not on their
    16-byte alignment (metadata read one scalar at a time, sliced at any offset).
    """
    def wrap(f: Callable) -> LazyKernel:
        return LazyKernel(f, tuple(do_not_specialize), tuple(do_not_specialize_on_alignment))

    return wrap if fn is None else wrap(fn)


def kernel_compiles() -> int:
    """Specialisations launched through Triton's dispatch so far, over every lazy kernel loaded."""
    return sum(k.num_compiles for k in _KERNELS)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of two non-negative ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_SMS: dict = {}  # device index -> multiprocessor count


def num_sms(device: Any) -> int:
    """Multiprocessor count of a CUDA device (cached per device); 8 for the CPU interpreter."""
    if device.type != "cuda":
        return 8
    n = _SMS.get(device.index)
    if n is None:
        import torch

        n = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


ARRIVAL_COUNTERS: dict = {}  # device -> zeroed int32 counters
_MIN_COUNTERS = 1 << 16


def arrival_counters(device: Any, n: int) -> Any:
    """At least n zeroed int32 counters on `device` for kernels whose programs take a ticket
    (`tl.atomic_add`) and whose last arrival finishes the work and sets its counter back to zero:
    one buffer per device, shared by every such kernel, since launches on one stream run one after
    the other (two streams running them at once would need their own). Made before any graph
    capture, at the eager warm-up launch (a capture cannot allocate a zeroed buffer for later)."""
    import torch

    buf = ARRIVAL_COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        check(not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()),
              "arrival counters must exist before a graph capture (launch the kernel once eagerly)")
        buf = ARRIVAL_COUNTERS[device] = torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=device)
    return buf


def check(cond: bool, msg: str, *fmt: Any) -> None:
    """Raise ValueError(msg.format(*fmt)) unless cond; the message is formatted only on failure."""
    if not cond:
        raise ValueError(msg.format(*fmt) if fmt else msg)


def bounded_put(cache: dict, key: Any, value: Any, limit: int = 1024) -> Any:
    """cache[key] = value, clearing the cache first when it holds `limit` entries; returns value."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


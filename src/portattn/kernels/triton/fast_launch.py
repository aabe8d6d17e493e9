"""A Triton launch repeated with new tensors, without Triton's argument binding each time.

An eager engine step launches the same kernels once per layer with the same grid, scalars and
constexprs; only the tensors differ (the layer's activations and cache). ``kernel[grid](...)`` binds
and specializes every argument each time (on an H200's host about 57 us for the attention kernel's
72 parameters, a third of a layer's attention host time). A :class:`RepeatLaunch` launches the
first time through Triton, keeps the compiled kernel Triton chose, and launches that kernel directly
afterwards, as long as every tensor argument keeps the dtype and 16-byte alignment of the first
launch (what Triton specializes tensors on); scalars and constexprs are the first launch's by
construction. Any other launch, and every launch under the Triton interpreter, goes through Triton.
"""

from __future__ import annotations

from operator import itemgetter

import torch

try:
    from triton.compiler.compiler import CompiledKernel
except ImportError:  # pragma: no cover - a Triton without the module: every launch through Triton
    CompiledKernel = None

FAST = True  # off: every launch through Triton (a switch for comparisons)


class RepeatLaunch:
    """``fn[grid](*args, **kwargs)`` now and again later with new tensors in the same places (:meth:`again`).

    ``args`` are the kernel's leading parameters in order, ``kwargs`` its constexprs and launch
    options by name; only positions in ``args`` may change between launches, and :meth:`again`
    takes a new ``args`` of the same length."""

    def __init__(self, fn, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        self.fn, self.grid, self.kwargs = fn, grid, kwargs
        compiled = fn[grid](*args, **kwargs)
        self.runner, self.signature = None, _signature(args)
        # What again() compares first, in few calls: the tensors' dtypes and alignment, and the other
        # arguments' types and values (equal values specialize alike); only where those differ, the
        # whole signature (a new integer that Triton specializes alike still takes the kept kernel).
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self._tensors_of = _getter(tensors)
        self._others_of = _getter([i for i in range(len(args)) if i not in set(tensors)])
        self._tensor_keys = tuple(map(_tensor_key, self._tensors_of(args)))
        self._values = self._others_of(args)
        self._types = tuple(map(type, self._values))
        self._num_args = len(args)
        if not FAST or CompiledKernel is None or not isinstance(compiled, CompiledKernel):
            return
        params = fn.params
        if len(args) > len(params) or any(p.name in kwargs for p in params[: len(args)]):
            return
        tail = []
        for p in params[len(args) :]:
            if p.name in kwargs:
                tail.append(kwargs[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return  # a parameter given by neither: Triton would have failed; never here
        self.tail = tuple(tail)
        self.runner = compiled[(*grid, 1, 1)[:3]]  # its launcher takes three grid dims

    def again(self, args: tuple) -> None:
        """The launch with new ``args``: the kept kernel where every tensor keeps its dtype and
        16-byte alignment, else Triton's (which compiles or finds the kernel for the new one)."""
        if self.runner is not None and self._specialized_alike(args):
            self.runner(*args, *self.tail)
        else:
            self.fn[self.grid](*args, **self.kwargs)

    def _specialized_alike(self, args: tuple) -> bool:
        """Whether ``args`` specialize as the first launch's did (:func:`_signature` equal), decided from the
        tensors' keys and the other arguments' types and values where those match."""
        if len(args) != self._num_args:
            return False
        values = self._others_of(args)
        try:
            same = tuple(map(type, values)) == self._types and values == self._values
            if same:
                return tuple(map(_tensor_key, self._tensors_of(args))) == self._tensor_keys
        except AttributeError:  # a tensor's place holds something else
            pass
        return _signature(args) == self.signature


def _getter(positions: list[int]):
    """A tuple of the items at ``positions`` of a sequence, in one C call where there are several."""
    if len(positions) > 1:
        return itemgetter(*positions)
    if positions:
        i = positions[0]
        return lambda args: (args[i],)
    return lambda args: ()


def _tensor_key(t: torch.Tensor) -> tuple:
    """What Triton specializes a tensor on: its dtype and whether its address is divisible by 16."""
    return t.dtype, t.data_ptr() % 16 == 0


def _signature(args: tuple) -> tuple:
    """At least what Triton specializes an argument on: a tensor's dtype and whether its address is
    divisible by 16; an integer's width and whether it is 1 or divisible by 16; other arguments'
    types (``None`` included)."""
    return tuple(map(_specialized, args))


def _specialized(a) -> object:
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if type(a) is int:
        return int, a == 1, a % 16 == 0, -(1 << 31) <= a < 1 << 31, a < 1 << 63
    return type(a)

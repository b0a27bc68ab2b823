"""How every torch_kernels op is registered with the PyTorch dispatcher.

Ops are declared with ``torch.library.Library.define`` and given one kernel per device dispatch
key, rather than with ``torch.library.custom_op``: a call then costs about 1.4 us of dispatch
instead of about 11 us, which matters for ops called several times per layer per decoded token.
The autograd kernel is ours too (``torch.library.register_autograd`` adds about 6 us to every call,
grad-free ones included). When no gradient is needed and the inputs are plain tensors with no
dispatch mode active, it calls the device kernel itself instead of dispatching a second time;
anything else (fake tensors while compiling, functionalization, vmap, FlopCounterMode) takes the
ordinary redispatch.

Every op also registers its cost here (:func:`register_cost`): a FLOP formula, which
``torch.utils.flop_counter.FlopCounterMode`` uses too, and a byte formula, what one call must move
at least. ``torch_kernels.profile`` divides both by the measured time (:func:`kernels_replaced_by`
swaps in its timed kernels while it is active, so the ordinary path carries no check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import warnings
from typing import Any, Callable

import torch
from torch.utils.flop_counter import register_flop_formula

LIB = torch.library.Library("torch_kernels", "DEF")
DEVICE_KEYS = ("CPU", "CUDA", "XPU")

_below_autograd = torch._C._AutoDispatchBelowAutograd
_grad_enabled = torch.is_grad_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_Tensor = torch.Tensor


def define(
    schema: str,
    kernel: Callable,
    fake: Callable,
    *,
    setup_context: Callable | None = None,
    backward: Callable | None = None,
    tags: tuple = (),
    library: torch.library.Library | None = None,
) -> torch._ops.OpOverload:
    """Define ``torch_kernels::<schema>``, its device kernel, fake and (optionally) autograd.

    ``setup_context(ctx, inputs, output)`` and ``backward(ctx, *grads)`` follow the conventions
    of ``torch.library.register_autograd``. Without them the op is inference-only: calling it
    with inputs that require grad raises. ``library``: a ``"FRAGMENT"`` library of the
    ``torch_kernels`` namespace to define the op in, for an op that :func:`undefine` removes
    again (a test's); by default the package's own.
    """
    name = schema.split("(", 1)[0]
    lib = LIB if library is None else library
    lib.define(schema, tags=tags)
    for key in DEVICE_KEYS:
        lib.impl(name, kernel, key)
    torch.library.register_fake(f"torch_kernels::{name}", fake, lib=lib)
    op = getattr(torch.ops.torch_kernels, name).default
    lib.impl(name, _autograd_kernel(op, kernel, setup_context, backward), "Autograd")
    _definitions[name] = _Definition(op, kernel, setup_context, backward)
    return op


@dataclasses.dataclass(frozen=True)
class _Definition:
    op: torch._ops.OpOverload
    kernel: Callable
    setup_context: Callable | None
    backward: Callable | None


_definitions: dict[str, _Definition] = {}


def undefine(name: str, library: torch.library.Library) -> None:
    """Remove op ``name``, defined by ``define(..., library=library)``, with all ``library`` holds."""
    if library is LIB:
        raise ValueError("undefine: the package's own ops stay defined")
    del _definitions[name]
    library._destroy()


@contextlib.contextmanager
def kernels_replaced_by(wrap: Callable[[torch._ops.OpOverload, Callable], Callable],
                        front: Callable[[torch._ops.OpOverload, Callable, Callable], Callable] | None = None):
    """Within this block every op defined here runs ``wrap(op, kernel)`` instead of its device kernel.

    The replacements are registered over the originals (device keys and the autograd kernel, whose
    fast path calls the device kernel directly) in a library fragment of their own; the dispatcher
    keeps the originals beneath and brings them back when the fragment closes on exit. Outside the
    block the ops run exactly as defined. ``front(op, kernel, autograd)``, where given, makes the
    autograd key's kernel instead: ``autograd`` is the autograd kernel over the wrapped one, for the
    calls it does not take itself (a call it takes must need no gradient and have plain tensors).
    """
    fragment = torch.library.Library("torch_kernels", "IMPL")
    # the fragment's dispatcher module directly: Library.impl refuses a second Python kernel for a
    # key in older torch (2.11 does), and newer ones forget the originals' keys when it closes
    register = fragment.m.impl
    try:
        with warnings.catch_warnings():  # overriding is the point here, not a mistake to warn about
            warnings.filterwarnings("ignore", message=".*(Overriding a previously registered kernel|Warning only once)")
            for name, d in _definitions.items():
                wrapped = wrap(d.op, d.kernel)
                for key in DEVICE_KEYS:
                    register(name, key, wrapped, False)
                autograd = _autograd_kernel(d.op, wrapped, d.setup_context, d.backward)
                register(name, "Autograd", autograd if front is None else front(d.op, d.kernel, autograd), False)
        yield
    finally:
        fragment._destroy()


# ---- costs: FLOP and byte formulas ----

Formula = Callable[[types.SimpleNamespace, Any], int]


@dataclasses.dataclass(frozen=True)
class Cost:
    """An op's FLOP and byte formulas; each takes ``(args, out)``: the call's arguments by their
    schema names (defaults filled in) and what the op returned."""

    flops: Formula
    bytes: Formula


_costs: dict[str, Cost] = {}


def bind_arguments(op: torch._ops.OpOverload, args: tuple, kwargs: dict | None = None) -> types.SimpleNamespace:
    """``op``'s call arguments by their schema names, with the defaults of those left out (the
    dispatcher drops trailing arguments at their defaults)."""
    values = dict(kwargs or {})
    for i, argument in enumerate(op._schema.arguments):
        if i < len(args):
            values[argument.name] = args[i]
        elif argument.name not in values:
            values[argument.name] = argument.default_value if argument.has_default_value() else None
    return types.SimpleNamespace(**values)


def register_cost(op: torch._ops.OpOverload, *, flops: Formula, bytes: Formula) -> None:  # noqa: A002 - the cost's name
    """Register ``op``'s FLOP and byte formulas, both ``f(args, out) -> int`` (see :class:`Cost`).

    FLOPs count 2 per multiply-add of the op's matrix products and reductions; elementwise maps
    (activations, softmax, quantization) are not counted, as in ``torch.utils.flop_counter``.
    Bytes are what one call must move at least: each input element it needs read once, each output
    element written once. The FLOP formula is registered with ``FlopCounterMode`` too.
    """
    name = op._opname
    if name in _costs:
        raise RuntimeError(f"register_cost: {name} already has its formulas")
    _costs[name] = Cost(flops, bytes)

    def flop_formula(*args, out_val=None, **kwargs) -> int:
        return flops(bind_arguments(op, args, kwargs), out_val)

    register_flop_formula(op.overloadpacket, get_raw=True)(flop_formula)


def cost_of(op_name: str) -> Cost | None:
    """The formulas registered for ``torch_kernels::<op_name>``, or None."""
    return _costs.get(op_name)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def tensor_bytes(*values) -> int:
    """The bytes of every tensor in ``values`` (tensors, None, or lists and tuples of them)."""
    return sum(t.numel() * t.element_size() for value in values for t in _tensors(value))


def io_bytes(args: types.SimpleNamespace, out) -> int:
    """Byte formula of an op that needs all of every tensor argument: each read once, the outputs written once."""
    return tensor_bytes(*vars(args).values(), out)


def _autograd_kernel(op, kernel, setup, backward_formula) -> Callable:
    arguments = op._schema.arguments
    tensor_positions = tuple(i for i, arg in enumerate(arguments) if isinstance(arg.type, torch.TensorType))
    optional_positions = tuple(
        i for i, arg in enumerate(arguments)
        if isinstance(arg.type, torch.OptionalType) and isinstance(arg.type.getElementType(), torch.TensorType)
    )
    if backward_formula is None:
        function = None
    else:

        class function(torch.autograd.Function):  # noqa: N801 - one per op, named after it
            @staticmethod
            def forward(*args):
                with _below_autograd():
                    return op(*args)

            setup_context = staticmethod(setup)
            backward = staticmethod(backward_formula)

        function.__name__ = function.__qualname__ = f"{op._opname}_autograd"

    def autograd_kernel(*args):  # the dispatcher passes every schema argument, positionally
        plain = _dispatch_modes() == 0
        grad = False
        for i in tensor_positions:  # a loop, not any()/all(): generators cost a microsecond here
            t = args[i]
            plain &= type(t) is _Tensor
            grad |= t.requires_grad
        for i in optional_positions:
            if i < len(args) and (t := args[i]) is not None:  # trailing defaults may be left out
                plain &= type(t) is _Tensor
                grad |= t.requires_grad
        if grad and _grad_enabled():
            if function is None:
                raise RuntimeError(
                    f"torch_kernels::{op._opname} is inference-only and has no backward; "
                    "call it under torch.no_grad() or on inputs that do not require grad"
                )
            return function.apply(*args)
        if plain:
            return kernel(*args)
        with _below_autograd():
            return op(*args)

    return autograd_kernel

"""How every torch_kernels op is registered with the PyTorch dispatcher.

Ops are declared with ``torch.library.Library.define`` and given one kernel per device dispatch
key, rather than with ``torch.library.custom_op``: a call then costs about 1.4 us of dispatch
instead of about 11 us, which matters for ops called several times per layer per decoded token.
The autograd kernel is ours too (``torch.library.register_autograd`` adds about 6 us to every call,
grad-free ones included). When no gradient is needed and the inputs are plain tensors with no
dispatch mode active, it calls the device kernel itself instead of dispatching a second time;
anything else (fake tensors while compiling, functionalization, vmap, FlopCounterMode) takes the
ordinary redispatch.
"""

from __future__ import annotations

from typing import Callable

import torch

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
) -> torch._ops.OpOverload:
    """Define ``torch_kernels::<schema>``, its device kernel, fake and (optionally) autograd.

    ``setup_context(ctx, inputs, output)`` and ``backward(ctx, *grads)`` follow the conventions
    of ``torch.library.register_autograd``. Without them the op is inference-only: calling it
    with inputs that require grad raises.
    """
    name = schema.split("(", 1)[0]
    LIB.define(schema, tags=tags)
    for key in DEVICE_KEYS:
        LIB.impl(name, kernel, key)
    torch.library.register_fake(f"torch_kernels::{name}", fake, lib=LIB)
    op = getattr(torch.ops.torch_kernels, name).default
    LIB.impl(name, _autograd_kernel(op, kernel, setup_context, backward), "Autograd")
    return op


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

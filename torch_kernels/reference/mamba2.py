"""Mamba-2's selective state space step in plain PyTorch: the reference backend's decode update.

Per batch entry ``b`` (state row ``r``), head ``h`` of group ``g = h // (H / G)``, head channel
``p`` and state entry ``n``, with ``d = dt[b, h, p] (+ dt_bias[h, p], then softplus if asked)``::

    state[r, h, p, n] = exp(d * A[h, p, n]) * state[r, h, p, n] + d * x[b, h, p] * B[b, g, n]
    out[b, h, p] = sum_n state[r, h, p, n] * C[b, g, n]  (+ D[h, p] * x[b, h, p])  (* silu(z[b, h, p]))

``out`` reads the new state before it is rounded to the state's dtype. Arithmetic in float32
(float64 for float64 x). The chunked scan over a whole sequence is the same recurrence run by
``chunk_simple_gla`` (see ``torch_kernels.ops.mamba2``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def heads_of_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., G, N]`` to ``[..., H, N]``: head ``h`` takes group ``h // (H / G)``."""
    *lead, groups, dstate = t.shape
    # unsqueeze, expand and reshape: torchax tensors keep autograd through these (not through
    # repeat_interleave or indexing with None)
    return t.unsqueeze(-2).expand(*lead, groups, heads // groups, dstate).reshape(*lead, heads, dstate)


def step_size(dt, dt_bias, softplus: bool, wide: torch.dtype) -> torch.Tensor:
    """``dt (+ dt_bias)``, through softplus if asked, in ``wide``."""
    d = dt.to(wide)
    if dt_bias is not None:
        d = d + dt_bias.to(wide)
    return F.softplus(d) if softplus else d


def selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, softplus: bool, rows) -> torch.Tensor:
    """One decode step (see the module docstring): ``x [Bt, H, P]``, ``dt [Bt, H, P]``, ``A [H, P, N]``,
    ``B``/``C [Bt, G, N]``, ``D``/``dt_bias [H, P]`` or None, ``z`` like x or None, ``rows`` int
    ``[Bt]`` (a negative row: padding, out zeros and no row written) or None; ``state [R, H, P, N]``
    written in place in the rows used. Any strides (models pass expanded views)."""
    wide = compute_dtype(x.dtype)
    heads = x.shape[1]
    d = step_size(dt, dt_bias, softplus, wide).unsqueeze(-1)
    xs = x.to(wide)
    if rows is None:  # every row in order: no gather, no scatter
        old, lines, live = state.to(wide), None, None
    else:
        lines = rows.long()
        live = lines >= 0
        old = state[lines.clamp(min=0)].to(wide)
    new = torch.exp(d * A.to(wide)) * old + (d * xs.unsqueeze(-1)) * heads_of_groups(B.to(wide), heads).unsqueeze(-2)
    out = torch.matmul(new, heads_of_groups(C.to(wide), heads).unsqueeze(-1)).squeeze(-1)
    if D is not None:
        out = out + D.to(wide) * xs
    if z is not None:
        out = out * F.silu(z.to(wide))
    if rows is None:
        state.copy_(new)
        return out.to(x.dtype)
    out = torch.where(live[:, None, None], out, torch.zeros((), dtype=wide, device=x.device))
    if bool(live.any()):
        state[lines[live]] = new[live].to(state.dtype)
    return out.to(x.dtype)

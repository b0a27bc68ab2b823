"""Mahalanobis and EDM scoring in plain PyTorch.

``mahalanobis_score_naive`` is the definition, written for reading. ``mahalanobis_min`` is the
reference backend's kernel (the CPU default): the same numbers in the form every backend's fused
kernel computes, checked against the definition in the tests. ``edm_score_naive`` and
``edm_score_levels`` are the same pair for EDM scoring.
"""

from __future__ import annotations

import functools

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and accumulators are float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without its cost (about 0.6 us) when ``t`` already has that dtype."""
    return t if t.dtype == dtype else t.to(dtype)


def mahalanobis_score_naive(x: torch.Tensor, means: torch.Tensor, whitener: torch.Tensor) -> torch.Tensor:
    """min over classes c of ||(x - means[c]) @ whitener||^2, one class at a time."""
    dtype = compute_dtype(x.dtype)
    x, means, whitener = x.to(dtype), means.to(dtype), whitener.to(dtype)
    per_class = [((x - mean) @ whitener).square().sum(dim=1) for mean in means]
    return torch.stack(per_class, dim=1).min(dim=1).values


def class_terms(means: torch.Tensor, whitener: torch.Tensor, dtype: torch.dtype):
    """The per-class part of the fused form, computed once per call.

    Rows are centred on the mean of the class means before whitening, so that for one class the
    fused form is exactly ||(x - mean) W||^2 and for several the expansion
    ||y||^2 - 2 y.p_c + ||p_c||^2 cancels only the (small) spread of the class means.
    Returns ``center [D]``, ``class_proj [C, D]`` (= (means - center) W) and ``class_sq [C]``.
    """
    means = as_dtype(means, dtype)
    if means.shape[0] == 1:  # the common label-free case: nothing to whiten
        return (means[0], *_zero_class_terms(means.shape[1], dtype, means.device))
    center = means.mean(dim=0)
    class_proj = (means - center) @ as_dtype(whitener, dtype)
    return center, class_proj, class_proj.square().sum(dim=1)


@functools.lru_cache(maxsize=32)
def _zero_class_terms(d: int, dtype: torch.dtype, device: torch.device):
    # Read-only inputs of the kernels, shared by every label-free call instead of allocated per call
    # (made outside inference mode so that they may meet autograd-tracked tensors).
    with torch.inference_mode(False):
        return torch.zeros(1, d, dtype=dtype, device=device), torch.zeros(1, dtype=dtype, device=device)


def mahalanobis_min(
    x: torch.Tensor,
    center: torch.Tensor,
    whitener: torch.Tensor,
    class_proj: torch.Tensor,
    class_sq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend kernel contract of ``mahalanobis_score``.

    ``y = (x - center) @ whitener``; ``d[b, c] = ||y_b||^2 - 2 y_b . class_proj[c] + class_sq[c]``;
    returns ``(max(min_c d, 0), argmin_c d)`` as (float32 or float64 ``[B]``, int64 ``[B]``).
    """
    dtype = center.dtype
    y = (as_dtype(x, dtype) - center) @ as_dtype(whitener, dtype)
    if class_proj.shape[0] == 1:  # y . (y - 2 p) + ||p||^2, without a [B, 1] matrix
        score = torch.linalg.vecdot(y, torch.sub(y, class_proj, alpha=2.0)).add_(class_sq)
        return score.clamp_(min=0.0), torch.zeros(y.shape[0], dtype=torch.int64, device=y.device)
    distances = torch.addmm(class_sq, y, class_proj.T, alpha=-2.0)
    distances += y.square().sum(dim=1, keepdim=True)
    score, nearest = distances.min(dim=1)
    return score.clamp_(min=0.0), nearest


# ---- EDM diffusion scoring ----
#
# The denoiser of Karras et al. (2022), D(y; s) = c_skip(s) y + c_out(s) F(c_in(s) y; c_noise(s)),
# with F the residual MLP below. ``edm_score_naive`` is the definition, written for reading (torch.func
# computes the divergence's Jacobian-vector product); ``edm_score_levels`` is the reference backend's
# kernel: the same numbers in the form every fused kernel computes (the tangent carried through the
# MLP by hand), and the function whose vector-Jacobian product is the op's backward.

EDM_STATISTICS = ("denoise", "scoped")


def edm_preconditioning(sigma: torch.Tensor, sigma_data: float):
    """EDM's ``(c_skip, c_out, c_in, c_noise)`` at noise levels ``sigma``:
    ``sd^2 / (s^2 + sd^2)``, ``s sd / sqrt(s^2 + sd^2)``, ``1 / sqrt(s^2 + sd^2)``, ``ln(s) / 4``."""
    total = sigma.square() + sigma_data**2
    return sigma_data**2 / total, sigma * sigma_data / total.sqrt(), total.rsqrt(), sigma.log() / 4


def edm_loss_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """EDM's loss weight ``(s^2 + sd^2) / (s sd)^2``: a unit-variance target at every level."""
    return (sigma.square() + sigma_data**2) / (sigma * sigma_data).square()


def edm_level_coefficients(sigmas: torch.Tensor, sigma_data: float, dtype: torch.dtype) -> torch.Tensor:
    """``[L, 4]`` table the kernels read per level: ``(sigma, c_in, c_skip, c_out)``."""
    sigmas = sigmas.to(dtype)
    c_skip, c_out, c_in, _ = edm_preconditioning(sigmas, sigma_data)
    return torch.stack([sigmas, c_in, c_skip, c_out], dim=1).contiguous()


def _silu_and_slope(h: torch.Tensor):
    """silu(h) and its derivative sig(h) (1 + h (1 - sig(h)))."""
    gate = torch.sigmoid(h)
    return h * gate, gate * (1 + h * (1 - gate))


def _silu_curvature(h: torch.Tensor) -> torch.Tensor:
    """silu''(h) = sig(h) (1 - sig(h)) (2 + h (1 - 2 sig(h)))."""
    gate = torch.sigmoid(h)
    return gate * (1 - gate) * (2 + h * (1 - 2 * gate))


def _mlp_forward(u, bias, w_in, w1, b1, w2, b2, w_out, b_out, tangent=None):
    """``(F, J_F tangent or None, tape)``: the MLP of ``edm_mlp`` with what its backward needs,
    ``tape = (h_0, [(h_k, z_k), ...], h_K)`` and the tangents ``(th_0, [th_k, ...], th_K)`` (or None)."""
    h = u @ w_in + bias
    th = None if tangent is None else tangent @ w_in
    blocks, tangents = [], []
    for k in range(w1.shape[0]):
        a, slope = _silu_and_slope(h)
        z = a @ w1[k] + b1[k]
        t, z_slope = _silu_and_slope(z)
        blocks.append((h, z))
        tangents.append(th)
        h = h + t @ w2[k] + b2[k]
        if th is not None:
            th = th + (z_slope * ((slope * th) @ w1[k])) @ w2[k]
    a, slope = _silu_and_slope(h)
    out = a @ w_out + b_out
    tf = None if th is None else (slope * th) @ w_out
    return out, tf, (blocks, h, tangents, th)


def edm_mlp(u, bias, w_in, w1, b1, w2, b2, w_out, b_out, tangent=None):
    """The residual MLP ``F`` on rows ``u [..., D]``, and with ``tangent [..., D]`` its Jacobian-vector product.

    ``h = u @ w_in + bias`` (``bias`` broadcast against ``[..., H]``: the input bias plus the
    noise-level embedding); ``K = w1.shape[0]`` pre-activation residual blocks
    ``h += silu(silu(h) @ w1[k] + b1[k]) @ w2[k] + b2[k]``; ``F = silu(h) @ w_out + b_out``.
    Returns ``F`` (and ``J_F(u) @ tangent``, carried forward layer by layer, when a tangent is given).
    """
    out, tf, _ = _mlp_forward(u, bias, w_in, w1, b1, w2, b2, w_out, b_out, tangent)
    return out if tangent is None else (out, tf)


def edm_score_naive(x, mean, inv_scale, noise, level_weights, level_bias, w_in, w1, b1, w2, b2, w_out, b_out,
                    sigmas, sigma_data: float, statistic: str = "denoise") -> torch.Tensor:
    """The EDM score of each row of ``x``, one noise level at a time (the definition).

    ``y = (x - mean) * inv_scale``; at level ``l`` (noise ``sigma_l``, fixed noise vector ``n_l``,
    weight ``w_l``; ``sigmas`` a sequence of floats), with ``D_l(v) = c_skip v + c_out F(c_in v; level_bias[l])``:

    - ``"denoise"``: ``w_l ||D_l(y + sigma_l n_l) - y||^2``;
    - ``"scoped"``: ``w_l (||D_l(y) - y||^2 / sigma_l^2 + n_l . (J_{D_l}(y) n_l) - ||n_l||^2)``, which is
      ``sigma_l^2 (||s||^2 + n_l . (grad s) n_l)`` for the score ``s = (D_l(y) - y) / sigma_l^2``:
      its squared norm plus Hutchinson's one-probe estimate of its divergence.

    The score is the sum over levels. Computed in float64 for float64 ``x``, float32 otherwise.
    """
    dtype = compute_dtype(x.dtype)
    cast = [t.to(dtype) for t in (x, mean, inv_scale, noise, level_weights, level_bias, w_in, w1, b1, w2, b2,
                                   w_out, b_out)]
    x, mean, inv_scale, noise, level_weights, level_bias, *weights = cast
    y = (x - mean) * inv_scale
    total = torch.zeros(x.shape[0], dtype=dtype, device=x.device)
    for sigma, n, weight, bias in zip(torch.tensor(sigmas, dtype=torch.float64).to(dtype), noise, level_weights,
                                      level_bias):
        c_skip, c_out, c_in, _ = edm_preconditioning(sigma, sigma_data)

        def denoiser(v, c_skip=c_skip, c_out=c_out, c_in=c_in, bias=bias):
            return c_skip * v + c_out * edm_mlp(c_in * v, bias, *weights)

        if statistic == "denoise":
            level = (denoiser(y + sigma * n) - y).square().sum(dim=1)
        else:
            out, jvp = torch.func.jvp(denoiser, (y,), (n.expand_as(y),))
            level = (out - y).square().sum(dim=1) / sigma**2 + (jvp * n).sum(dim=1) - n.square().sum()
        total = total + weight * level
    return total


_EDM_CHUNK_ROWS = 16384  # rows of all levels together per batched pass: bounds the activations' memory


def edm_score_levels(x, mean, inv_scale, coefficients, noise, level_weights, level_bias, w_in, w1, b1, w2, b2,
                     w_out, b_out, scoped: bool) -> torch.Tensor:
    """The backend kernel contract of ``edm_score``: ``[B]`` scores, float32 (float64 for float64 ``x``).

    ``coefficients [L, 4]`` holds ``(sigma, c_in, c_skip, c_out)`` per level; every other tensor is
    in the compute dtype except ``x``. The tangent of ``"scoped"`` is carried through the MLP
    alongside its input (one Jacobian-vector product per level), as the fused kernels do. All
    levels go through the MLP as one batch (``[L, rows, D]``), a chunk of rows at a time, so that
    a small batch costs a handful of large matmuls rather than a few per level.
    """
    dtype = coefficients.dtype
    levels = coefficients.shape[0]
    sigma, c_in, c_skip, c_out = (c[:, None, None] for c in coefficients.T)  # [L, 1, 1] each
    n = noise[:, None, :]
    bias = level_bias[:, None, :]
    weights = (w_in, w1, b1, w2, b2, w_out, b_out)
    scores = []
    for rows in as_dtype(x, dtype).split(max(1, _EDM_CHUNK_ROWS // levels)):
        y = (rows - mean) * inv_scale
        if scoped:
            f, tf = edm_mlp(c_in * y, bias, *weights, tangent=(c_in * n).expand(levels, *y.shape))
            residual = c_skip * y + c_out * f - y
            level = (residual.square().sum(dim=2) / sigma[:, :, 0].square() + (c_out * tf * n).sum(dim=2)
                     + (c_skip[:, :, 0] - 1) * n.square().sum(dim=2))
        else:
            noisy = y + sigma * n
            level = (c_skip * noisy + c_out * edm_mlp(c_in * noisy, bias, *weights) - y).square().sum(dim=2)
        scores.append(level_weights @ level)
    return torch.cat(scores) if scores else x.new_zeros(0, dtype=dtype)


def edm_score_levels_backward(grad, x, mean, inv_scale, coefficients, noise, level_weights, level_bias, w_in, w1,
                              b1, w2, b2, w_out, b_out, scoped: bool):
    """Gradients of ``sum(grad * edm_score_levels(...))`` in ``x`` and every tensor after
    ``coefficients`` (in argument order), by reverse mode written out in torch ops: the forward
    (and its tangent) is recomputed level by level, then walked back. Differentiable again."""
    dtype = coefficients.dtype
    grad = grad.to(dtype)
    diff = as_dtype(x, dtype) - mean
    y = diff * inv_scale
    d_y = torch.zeros_like(y)
    d_noise = torch.zeros_like(noise)
    d_bias = torch.zeros_like(level_bias)
    d_w = [torch.zeros_like(t) for t in (w_in, w1, b1, w2, b2, w_out, b_out)]
    d_w_in, d_w1, d_b1, d_w2, d_b2, d_w_out, d_b_out = d_w
    d_level_weights = []
    for l, ((sigma, c_in, c_skip, c_out), n, weight) in enumerate(zip(coefficients, noise, level_weights)):
        u = c_in * y if scoped else c_in * (y + sigma * n)
        tangent = (c_in * n).expand_as(y) if scoped else None
        f, tf, (blocks, h, tangents, th) = _mlp_forward(u, level_bias[l], w_in, w1, b1, w2, b2, w_out, b_out, tangent)
        if scoped:
            residual = c_skip * y + c_out * f - y
            level = residual.square().sum(dim=1) / sigma.square() + (c_out * tf) @ n + (c_skip - 1) * n.square().sum()
            d_residual = (2 * weight / sigma.square()) * grad[:, None] * residual
            d_tf = (weight * c_out) * grad[:, None] * n
            d_noise[l] += weight * c_out * (grad @ tf) + (2 * weight * (c_skip - 1) * grad.sum()) * n
        else:
            residual = c_skip * (y + sigma * n) + c_out * f - y
            level = residual.square().sum(dim=1)
            d_residual = 2 * weight * grad[:, None] * residual
            d_tf = None
            d_noise[l] += (sigma * c_skip) * d_residual.sum(dim=0)
        d_level_weights.append(grad @ level)
        d_y += (c_skip - 1) * d_residual
        d_f = c_out * d_residual
        # output layer: f = silu(h) W_out + b_out, tf = (silu'(h) th) W_out
        a, slope = _silu_and_slope(h)
        d_w_out += a.T @ d_f
        d_b_out += d_f.sum(dim=0)
        d_h = (d_f @ w_out.T) * slope
        d_th = None
        if scoped:
            d_w_out += (slope * th).T @ d_tf
            d_ta = d_tf @ w_out.T
            d_h = d_h + d_ta * th * _silu_curvature(h)
            d_th = d_ta * slope
        # residual blocks, last first
        for k in reversed(range(w1.shape[0])):
            h_k, z = blocks[k]
            a, slope = _silu_and_slope(h_k)
            t, z_slope = _silu_and_slope(z)
            d_w2[k] += t.T @ d_h
            d_b2[k] += d_h.sum(dim=0)
            d_z = (d_h @ w2[k].T) * z_slope
            if scoped:
                th_k = tangents[k]
                ta = slope * th_k
                tz = ta @ w1[k]
                d_w2[k] += (z_slope * tz).T @ d_th
                d_tt = d_th @ w2[k].T
                d_z = d_z + d_tt * tz * _silu_curvature(z)
                d_tz = d_tt * z_slope
                d_w1[k] += ta.T @ d_tz
                d_ta = d_tz @ w1[k].T
            d_w1[k] += a.T @ d_z
            d_b1[k] += d_z.sum(dim=0)
            d_h = d_h + (d_z @ w1[k].T) * slope
            if scoped:
                d_h = d_h + d_ta * th_k * _silu_curvature(h_k)
                d_th = d_th + d_ta * slope
        # input layer: h_0 = u W_in + bias, th_0 = (c_in n) W_in
        d_bias[l] += d_h.sum(dim=0)
        d_w_in += u.T @ d_h
        d_u = d_h @ w_in.T
        if scoped:
            d_th_sum = d_th.sum(dim=0)
            d_w_in += torch.outer(c_in * n, d_th_sum)
            d_noise[l] += c_in * (w_in @ d_th_sum)
            d_y += c_in * d_u
        else:
            d_y += c_in * d_u
            d_noise[l] += (sigma * c_in) * d_u.sum(dim=0)
    d_diff = d_y * inv_scale
    return (d_diff.to(x.dtype), -d_diff.sum(dim=0), (d_y * diff).sum(dim=0), d_noise,
            torch.stack(d_level_weights), d_bias, *d_w)

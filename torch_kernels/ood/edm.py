"""Fit a small EDM diffusion model on in-distribution features, score by its denoising behaviour.

The denoiser is Karras et al.'s (2022) EDM, trained exactly as there, on standardized features;
a row's score is how badly the denoiser restores it over a fixed grid of noise levels
(``"denoise"``), or the score function's squared norm plus its divergence there (``"scoped"``,
after Barkley et al.'s SCOPED). Both are computed by the fused op ``torch_kernels.edm_score``.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
from torch import nn

from .. import _checks
from ..ops.ood import edm_score
from ..reference import ood as reference
from .scorer import FittedScorer

__all__ = ["EDMScorer", "edm_score"]

P_MEAN, P_STD = -1.2, 1.2  # EDM's training noise distribution: ln(sigma) ~ N(P_MEAN, P_STD^2)
FOURIER_FEATURES = 64  # cos and sin of this many random frequencies of c_noise
FOURIER_SCALE = 4.0  # their standard deviation (c_noise spans about -1.6 .. 1.1)
SPREAD_FLOOR = 1e-3  # features spread less than this times the typical feature are scaled as if they had it

# fitted tensors, in the order edm_score takes them after the standardization
_NETWORK = ("w_in", "b_in", "embedding", "w1", "b1", "w2", "b2", "w_out", "b_out")
_BUFFERS = ("mean_", "inv_scale_", "sigma_data_", "sigmas_", "noise_", "frequencies_")


class EDMScorer(FittedScorer):
    """EDM diffusion OOD scorer over frozen features, usable as a module inside models.

    Args:
        width: hidden width ``H`` of the denoiser's MLP.
        depth: residual blocks ``K``.
        levels: noise levels ``L`` of the scoring grid, log-spaced from ``sigma_min`` to ``sigma_max``
            (in units of the standardized features).
        probes: noise draws ``P`` per level: the grid the op evaluates holds ``L P`` (level, noise)
            pairs, so more probes average out more of the score's dependence on the drawn noise.
        statistic: ``"denoise"`` or ``"scoped"`` (below); ``score(x, statistic=...)`` overrides it.

    **Model.** Features are standardized with the fit data's per-feature mean and standard
    deviation, ``y = (x - mean) * inv_scale``, so that ``sigma_data`` (the root mean variance of
    ``y``) is about 1. The denoiser is EDM's
    ``D(y; s) = c_skip(s) y + c_out(s) F(c_in(s) y; c_noise(s))`` with ``c_skip = sd^2 / (s^2 + sd^2)``,
    ``c_out = s sd / sqrt(s^2 + sd^2)``, ``c_in = 1 / sqrt(s^2 + sd^2)``, ``c_noise = ln(s) / 4``.
    ``F`` is a residual MLP: the noise-level embedding ``e(s) = [cos 2 pi f c_noise, sin 2 pi f c_noise]
    @ embedding`` (64 fixed random frequencies ``f ~ N(0, 4^2)``) is added to the input layer,
    ``h = u @ w_in + b_in + e(s)``; then ``depth`` pre-activation blocks
    ``h += silu(silu(h) @ w1[k] + b1[k]) @ w2[k] + b2[k]``; ``F = silu(h) @ w_out + b_out``. The
    blocks' last layers and ``w_out`` start at zero, so training starts from ``D = c_skip y``.

    **Training** (``fit``): EDM's loss ``lambda(s) ||D(y + s n; s) - y||^2`` with
    ``lambda(s) = (s^2 + sd^2) / (s sd)^2``, ``ln s ~ N(-1.2, 1.2^2)``, ``n ~ N(0, I)``, averaged over
    the features; Adam with a linear warm-up and a cosine decay of the learning rate; the scorer
    keeps the exponential moving average of the weights (decay ``min(ema, (1 + t) / (10 + t))`` at
    step ``t``). Every random draw comes from ``seed``.

    **Scores** (``forward`` / ``score``), deterministic: the grid's ``G = L P`` pairs
    ``(s_g, n_g)`` (each level ``probes`` times, each with its own noise vector) are drawn once at fit
    and stored. With ``D_g`` the denoiser at level ``s_g``:

    - ``"denoise"`` (default): ``(1 / G D) sum_g lambda(s_g) ||D_g(y + s_g n_g) - y||^2``, the weighted
      denoising error (about 1 in distribution: the training loss at those levels);
    - ``"scoped"``: ``(1 / G D) sum_g s_g^2 (||s||^2 + n_g . (grad s) n_g)`` with the score function
      ``s = (D_g(y) - y) / s_g^2`` at the clean ``y``: its squared norm plus Hutchinson's estimate
      of its divergence with the probe ``n_g`` (one Jacobian-vector product per pair). By Stein's
      identity the two cancel on average in distribution; a point off the data has a large score
      norm. (SCOPED, Barkley et al. 2025, combines the same two terms; its calibration of the
      statistic by a kernel density estimate is not done here.)

    The default grid (``[0.8, 3]``, 8 levels x 4 probes) and size (width 256, depth 2, 3000 steps of
    256 rows) were chosen on CLINC150 with all-MiniLM-L6-v2 features, label-free
    (``benchmarks/ood.py``): the mid-to-high levels separate best there, and probes reduce the
    variance the single drawn noise vector adds.

    Higher means less in-distribution. ``threshold(features, tpr)`` is the score below which a
    fraction ``tpr`` of held-out in-distribution features fall. ``state_dict()`` carries the fitted
    weights (the moving average), the standardization, the grid and its noise.
    """

    DEFAULT_STEPS = 3000

    def __init__(self, width: int = 256, depth: int = 2, levels: int = 8, probes: int = 4, sigma_min: float = 0.8,
                 sigma_max: float = 3.0, statistic: str = "denoise"):
        super().__init__()
        for name, value, least in (("width", width, 1), ("depth", depth, 0), ("levels", levels, 1),
                                   ("probes", probes, 1)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
            if value < least:
                raise ValueError(f"{name}: expected an int >= {least}, got {value}")
        for name, value in (("sigma_min", sigma_min), ("sigma_max", sigma_max)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 < value < math.inf:
                raise ValueError(f"{name}: expected a finite float > 0, got {value!r}")
        if sigma_max < sigma_min:
            raise ValueError(f"sigma_max: expected at least sigma_min ({sigma_min}), got {sigma_max}")
        _check_statistic(statistic)
        self.width, self.depth, self.levels, self.probes = width, depth, levels, probes
        self.sigma_min, self.sigma_max = float(sigma_min), float(sigma_max)
        self.statistic = statistic
        for name in _NETWORK:
            setattr(self, name, nn.Parameter(torch.empty(0)))
        for name in _BUFFERS:
            self.register_buffer(name, torch.empty(0))
        # each statistic's weights per grid point, made from the grid (so not saved)
        for statistic in reference.EDM_STATISTICS:
            self.register_buffer(f"_{statistic}_weights", torch.empty(0), persistent=False)

    @property
    def fitted(self) -> bool:
        """Whether ``fit`` (or ``load_state_dict``) has given the scorer its weights."""
        return self.w_in.numel() > 0

    def extra_repr(self) -> str:
        shape = f", features={self.w_in.shape[0]}" if self.fitted else ""
        return (f"width={self.width}, depth={self.depth}, levels={self.levels}, probes={self.probes}, "
                f"sigma_min={self.sigma_min}, sigma_max={self.sigma_max}, statistic={self.statistic!r}{shape}")

    # ---- the denoiser ----

    def noise_embedding(self, sigma: torch.Tensor) -> torch.Tensor:
        """``[N, H]``: ``b_in`` plus the embedding of each noise level ``sigma [N]``."""
        angles = (2 * math.pi) * (sigma.log() / 4)[:, None] * self.frequencies_
        return torch.cat([angles.cos(), angles.sin()], dim=1) @ self.embedding + self.b_in

    def denoise(self, y: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """EDM's ``D(y; sigma)`` on standardized rows ``y [N, D]`` at per-row levels ``sigma [N]``."""
        c_skip, c_out, c_in, _ = reference.edm_preconditioning(sigma[:, None], float(self.sigma_data_))
        weights = (self.w_in, self.w1, self.b1, self.w2, self.b2, self.w_out, self.b_out)
        return c_skip * y + c_out * reference.edm_mlp(c_in * y, self.noise_embedding(sigma), *weights)

    def loss(self, y: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """EDM's training loss on standardized rows ``y``: the mean of ``lambda(s) (D(y + s n; s) - y)^2``."""
        weight = reference.edm_loss_weight(sigma, float(self.sigma_data_))
        return (weight[:, None] * (self.denoise(y + sigma[:, None] * noise, sigma) - y).square()).mean()

    # ---- fitting ----

    def fit(self, features: torch.Tensor | Iterable[torch.Tensor], steps: int | None = None, *,
            epochs: float | None = None, batch_size: int = 256, lr: float = 2e-3, ema: float = 0.999,
            seed: int = 0, progress: bool = True) -> "EDMScorer":
        """Train on ``[N, D]`` features, or an iterable of ``[n_i, D]`` batches (read once, held in memory).

        ``steps`` optimizer steps of ``batch_size`` rows (or ``epochs`` passes over the data;
        default ``DEFAULT_STEPS``), rows drawn by a fresh permutation each pass. ``progress`` shows a tqdm
        bar with the loss (if tqdm is installed). Deterministic given ``seed`` (on one machine and
        thread count). Returns ``self``.
        """
        data = _gather(features)
        for name, value in (("batch_size", batch_size), ("seed", seed)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size}")
        steps = _steps(steps, epochs, len(data), batch_size)
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not 0.0 < lr < math.inf:
            raise ValueError(f"lr: expected a finite float > 0, got {lr!r}")
        if not isinstance(ema, (int, float)) or isinstance(ema, bool) or not 0.0 <= ema < 1.0:
            raise ValueError(f"ema: expected a float in [0, 1), got {ema!r}")
        gen = torch.Generator(device=data.device).manual_seed(seed)
        y = self._standardize_and_init(data, gen)
        self._train(y, steps, batch_size, float(lr), float(ema), gen, progress)
        return self

    def _standardize_and_init(self, data: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Set the standardization, sigma_data, the grid's noise and the initial weights; the
        standardized float32 training rows."""
        n, d = data.shape
        device = data.device
        mean = data.mean(dim=0, dtype=torch.float64)
        spread = (data.to(torch.float64) - mean).square().mean(dim=0).sqrt()
        typical = spread.square().mean().sqrt()
        if typical == 0:
            raise ValueError("features: every feature is constant; there is nothing to fit")
        inv_scale = 1.0 / spread.clamp_min(SPREAD_FLOOR * typical)
        y = ((data.to(torch.float64) - mean) * inv_scale).to(torch.float32)
        h, k = self.width, self.depth

        def normal(*shape, std=1.0):
            return torch.randn(*shape, generator=gen, device=device) * std

        with torch.no_grad():
            self.mean_, self.inv_scale_ = mean.to(torch.float32), inv_scale.to(torch.float32)
            self.sigma_data_ = y.var(dim=0, unbiased=False).mean().sqrt()
            grid = torch.logspace(math.log10(self.sigma_min), math.log10(self.sigma_max), self.levels,
                                  dtype=torch.float64).repeat_interleave(self.probes)
            self.sigmas_ = grid.to(device=device, dtype=torch.float32)
            self.noise_ = normal(grid.numel(), d)
            self.frequencies_ = normal(FOURIER_FEATURES, std=FOURIER_SCALE)
            initial = {
                "w_in": normal(d, h, std=d**-0.5), "b_in": torch.zeros(h, device=device),
                "embedding": normal(2 * FOURIER_FEATURES, h, std=FOURIER_FEATURES**-0.5),
                "w1": normal(k, h, h, std=h**-0.5), "b1": torch.zeros(k, h, device=device),
                "w2": torch.zeros(k, h, h, device=device), "b2": torch.zeros(k, h, device=device),
                "w_out": torch.zeros(h, d, device=device), "b_out": torch.zeros(d, device=device),
            }
        for name, value in initial.items():
            setattr(self, name, nn.Parameter(value))
        self._refresh_level_weights()
        return y

    def _train(self, y, steps, batch_size, lr, ema, gen, progress) -> None:
        params = [getattr(self, name) for name in _NETWORK]
        average = [p.detach().clone() for p in params]
        optimizer = torch.optim.Adam(params, lr=lr)
        warmup = max(1, min(100, steps // 10))
        bar = _progress(range(steps), progress)
        n = y.shape[0]
        order, position = torch.randperm(n, generator=gen, device=y.device), 0
        for step in bar:
            if position + batch_size > n:  # a new pass over the data
                order, position = torch.randperm(n, generator=gen, device=y.device), 0
            rows = y[order[position:position + batch_size]]
            position += batch_size
            sigma = (torch.randn(rows.shape[0], generator=gen, device=y.device) * P_STD + P_MEAN).exp()
            noise = torch.randn(rows.shape, generator=gen, device=y.device)
            loss = self.loss(rows, sigma, noise)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for group in optimizer.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
            optimizer.step()
            decay = min(ema, (1 + step) / (10 + step))
            with torch.no_grad():
                torch._foreach_lerp_(average, [p.detach() for p in params], 1 - decay)
            if hasattr(bar, "set_postfix") and (step % 25 == 0 or step == steps - 1):
                bar.set_postfix(loss=f"{loss.item():.4f}")
        with torch.no_grad():
            for p, a in zip(params, average):
                p.copy_(a)
                p.grad = None  # the last step's gradient belongs to the online weights, not these

    def _refresh_level_weights(self) -> None:
        # the grid as Python floats (what the op takes; constants to torch.compile), and the weights
        # of the two statistics per grid point: lambda(s) / (G D) and 1 / (G D)
        self._grid = (self.sigmas_.tolist(), float(self.sigma_data_))
        scale = 1.0 / (self.sigmas_.numel() * self.w_in.shape[0])
        denoise = reference.edm_loss_weight(self.sigmas_.to(torch.float64), float(self.sigma_data_)) * scale
        self._denoise_weights = denoise.to(torch.float32)
        self._scoped_weights = torch.full_like(self.sigmas_, scale)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # an unfitted scorer's tensors are empty: take the saved shapes
        for name in (*_NETWORK, *_BUFFERS):
            if prefix + name in state_dict:
                saved = state_dict[prefix + name]
                empty = torch.empty_like(saved, device=getattr(self, name).device)
                setattr(self, name, nn.Parameter(empty) if name in _NETWORK else empty)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "sigmas_" in state_dict and self.fitted:
            self.width, self.depth = self.w_in.shape[1], self.w1.shape[0]
            self.levels = self.sigmas_.unique().numel()
            self.probes = self.sigmas_.numel() // self.levels
            self.sigma_min, self.sigma_max = float(self.sigmas_[0]), float(self.sigmas_[-1])
            self._refresh_level_weights()

    # ---- scoring ----

    def forward(self, x: torch.Tensor, statistic: str | None = None,
                implementation: str | Sequence[str] | None = None) -> torch.Tensor:
        """``[B]`` scores of ``x [B, D]`` (float32; float64 for float64 ``x``) by the ``edm_score`` op;
        differentiable in ``x`` and in the weights."""
        self._require_fitted()
        statistic = _check_statistic(self.statistic if statistic is None else statistic)
        weights = getattr(self, f"_{statistic}_weights")
        level_bias = self.noise_embedding(self.sigmas_)
        return edm_score(x, self.mean_, self.inv_scale_, self.noise_, weights, level_bias, self.w_in, self.w1,
                         self.b1, self.w2, self.b2, self.w_out, self.b_out, self._grid[0], self._grid[1],
                         statistic, implementation)

    score = forward


def _check_statistic(statistic) -> str:
    if statistic not in reference.EDM_STATISTICS:
        raise ValueError(f"statistic: expected one of {reference.EDM_STATISTICS}, got {statistic!r}")
    return statistic


def _gather(features) -> torch.Tensor:
    """The fit data as one ``[N, D]`` float32 tensor, checked batch by batch."""
    batches = [features] if isinstance(features, torch.Tensor) else list(features)
    width = None
    for i, batch in enumerate(batches):
        _checks.tensor("features", batch, ndim=2, dtypes=_checks.FLOAT_DTYPES)
        if batch.shape[1] == 0:
            raise ValueError("features: expected at least one feature, got shape (N, 0)")
        if width is not None and batch.shape[1] != width:
            raise ValueError(f"features: batch {i} has {batch.shape[1]} features, the first had {width}")
        width = batch.shape[1]
        if not torch.isfinite(batch).all():
            raise ValueError(f"features: batch {i} contains NaN or inf")
    rows = sum(batch.shape[0] for batch in batches)
    if rows < 2:
        raise ValueError(f"features: expected at least 2 rows, got {rows}")
    return torch.cat([batch.to(torch.float32) for batch in batches])


def _steps(steps, epochs, rows: int, batch_size: int) -> int:
    if steps is not None and epochs is not None:
        raise ValueError(f"steps: expected steps or epochs, not both; got steps={steps!r}, epochs={epochs!r}")
    if epochs is not None:
        if not isinstance(epochs, (int, float)) or isinstance(epochs, bool) or not 0.0 < epochs < math.inf:
            raise ValueError(f"epochs: expected a finite number > 0, got {epochs!r}")
        return max(1, math.ceil(epochs * rows / batch_size))
    if steps is None:
        return EDMScorer.DEFAULT_STEPS
    if not isinstance(steps, int) or isinstance(steps, bool):
        raise TypeError(f"steps: expected an int, got {type(steps).__name__} {steps!r}")
    if steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps}")
    return steps


def _progress(steps, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return steps
    return tqdm(steps, desc="EDM fit", unit="step", disable=not enabled)

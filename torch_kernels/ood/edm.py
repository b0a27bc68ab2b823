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
from .mahalanobis import constant_features
from .scorer import FittedScorer

__all__ = ["EDMScorer", "edm_score"]

P_MEAN, P_STD = -1.2, 1.2  # EDM's training noise distribution: ln(sigma) ~ N(P_MEAN, P_STD^2)
FOURIER_FEATURES = 64  # cos and sin of this many random frequencies of c_noise
FOURIER_SCALE = 4.0  # their standard deviation (c_noise spans about -1.6 .. 1.1)

# fitted tensors, in the order edm_score takes them after the standardization
_NETWORK = ("w_in", "b_in", "embedding", "w1", "b1", "w2", "b2", "w_out", "b_out")
_BUFFERS = ("mean_", "inv_scale_", "sigma_data_", "sigmas_", "noise_", "frequencies_")


class EDMScorer(FittedScorer):
    """EDM diffusion OOD scorer over frozen features, usable as a module inside models.

    Args:
        width: hidden width ``H`` of the denoiser's MLP (256 when not given).
        depth: residual blocks ``K`` (2).
        levels: noise levels ``L`` of the scoring grid, log-spaced from ``sigma_min`` (0.8) to
            ``sigma_max`` (3.0), in units of the standardized features (8).
        probes: noise draws ``P`` per level: the grid the op evaluates holds ``L P`` (level, noise)
            pairs, so more probes average out more of the score's dependence on the drawn noise (4).
        statistic: ``"denoise"`` or ``"scoped"`` (below); ``score(x, statistic=...)`` overrides it.
        ridge: added to every feature's variance before standardizing, as ``MahalanobisScorer``'s
            ``ridge`` is to its covariance's diagonal (0: none).

    **Model.** Features are standardized with the fit data's per-feature mean and standard
    deviation, ``y = (x - mean) * inv_scale`` with ``inv_scale = 1 / sqrt(variance + ridge)``, so
    that ``sigma_data`` (the root mean variance of ``y``) is about 1. A feature constant in the fit
    data (zero variance, or below ``D`` float64 epsilons of the largest: the dead output dimensions
    of encoders such as all-MiniLM-L6-v2) is centred and not divided, ``inv_scale = 1``, as
    scikit-learn's ``StandardScaler`` does; a deviation from its constant at scoring then counts in
    the feature's own units. The denoiser is EDM's
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

    Higher means less in-distribution. ``score(x)`` gives plain scores (no autograd graph through
    the weights; one to ``x`` only when ``x`` requires grad); calling the module (``forward``) is
    differentiable in ``x`` and in every weight. ``threshold(features, tpr)`` is the score below which
    a fraction ``tpr`` of held-out in-distribution features fall.

    **Saving.** ``state_dict()`` carries the fitted weights (the moving average), the
    standardization, the grid and its noise; the configuration follows from their shapes and the
    grid. ``load_state_dict`` checks the arguments given to the constructor against it: a state
    dict of another ``width``, ``depth``, ``levels``, ``probes``, ``sigma_min`` or ``sigma_max`` than
    one given raises the ``RuntimeError`` of ``torch.nn.Module.load_state_dict`` naming the argument
    (as torch does for a shape mismatch), and the scorer keeps its state. An argument not given
    takes the state dict's value, so ``EDMScorer().load_state_dict(saved)`` restores any scorer.
    ``statistic`` and ``ridge`` are not in the state dict (``ridge`` is already in ``inv_scale_``).
    """

    DEFAULT_STEPS = 3000
    DEFAULTS = {"width": 256, "depth": 2, "levels": 8, "probes": 4, "sigma_min": 0.8, "sigma_max": 3.0}

    def __init__(self, width: int | None = None, depth: int | None = None, levels: int | None = None,
                 probes: int | None = None, sigma_min: float | None = None, sigma_max: float | None = None,
                 statistic: str = "denoise", ridge: float = 0.0):
        super().__init__()
        given = {name: value for name, value in (("width", width), ("depth", depth), ("levels", levels),
                                                 ("probes", probes), ("sigma_min", sigma_min),
                                                 ("sigma_max", sigma_max)) if value is not None}
        config = {**self.DEFAULTS, **given}
        for name, least in (("width", 1), ("depth", 0), ("levels", 1), ("probes", 1)):
            value = config[name]
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
            if value < least:
                raise ValueError(f"{name}: expected an int >= {least}, got {value}")
        for name in ("sigma_min", "sigma_max"):
            value = config[name]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 < value < math.inf:
                raise ValueError(f"{name}: expected a finite float > 0, got {value!r}")
        if config["sigma_max"] < config["sigma_min"]:
            raise ValueError(f"sigma_max: expected at least sigma_min ({config['sigma_min']}), "
                             f"got {config['sigma_max']}")
        if not isinstance(ridge, (int, float)) or isinstance(ridge, bool) or not 0.0 <= ridge < math.inf:
            raise ValueError(f"ridge: expected a finite float >= 0, got {ridge!r}")
        _check_statistic(statistic)
        self.width, self.depth, self.levels, self.probes = (config[name] for name in ("width", "depth", "levels",
                                                                                       "probes"))
        self.sigma_min, self.sigma_max = float(config["sigma_min"]), float(config["sigma_max"])
        self.statistic, self.ridge = statistic, float(ridge)
        self._pinned = tuple(given)  # what load_state_dict must agree with
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
        ridge = f", ridge={self.ridge}" if self.ridge else ""
        return (f"width={self.width}, depth={self.depth}, levels={self.levels}, probes={self.probes}, "
                f"sigma_min={self.sigma_min}, sigma_max={self.sigma_max}, statistic={self.statistic!r}{ridge}{shape}")

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
        data64 = data.to(torch.float64)
        mean = data64.mean(dim=0)
        variance = (data64 - mean).square().mean(dim=0)
        if variance.max() == 0:
            raise ValueError("features: every feature is constant; there is nothing to fit")
        variance += self.ridge
        # a constant feature is centred, not divided (scale 1, as scikit-learn's StandardScaler)
        variance = torch.where(constant_features(variance), 1.0, variance)
        mean32, inv_scale32 = mean.to(torch.float32), variance.rsqrt().to(torch.float32)
        # standardized as scoring will: with the stored float32 mean and scale, not the float64 ones
        y = ((data64 - mean32.double()) * inv_scale32.double()).to(torch.float32)
        h, k = self.width, self.depth

        def normal(*shape, std=1.0):
            return torch.randn(*shape, generator=gen, device=device) * std

        with torch.no_grad():
            self.mean_, self.inv_scale_ = mean32, inv_scale32
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

    def _saved_config(self, state_dict, prefix) -> dict:
        """The configuration a saved scorer was made with, as far as its tensors in ``state_dict`` tell."""
        config = {}
        w_in, w1, sigmas = (state_dict.get(prefix + name) for name in ("w_in", "w1", "sigmas_"))
        if isinstance(w_in, torch.Tensor) and w_in.ndim == 2:
            config["width"] = w_in.shape[1]
        if isinstance(w1, torch.Tensor) and w1.ndim == 3:
            config["depth"] = w1.shape[0]
        if isinstance(sigmas, torch.Tensor) and sigmas.ndim == 1 and sigmas.numel():
            counts = torch.unique_consecutive(sigmas, return_counts=True)[1]
            levels, probes = len(counts), int(counts[0])
            if levels == 1 and self.levels * self.probes == sigmas.numel():
                levels, probes = self.levels, self.probes  # one level repeated G times: any split of G is that grid
            config.update(levels=levels, probes=probes, sigma_min=float(sigmas[0]), sigma_max=float(sigmas[-1]))
        return config

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        saved = self._saved_config(state_dict, prefix)
        conflicts = [name for name in self._pinned if name in saved and not _same(saved[name], getattr(self, name))]
        if conflicts:  # reported as torch reports a size mismatch, before anything is changed
            error_msgs.append("; ".join(
                f"{name}: this EDMScorer was made with {name}={getattr(self, name)!r} but the state dict holds a "
                f"scorer of {name}={saved[name]!r}; make it with {name}={saved[name]!r}, or leave {name} out to "
                "take the state dict's" for name in conflicts))
            return
        # an unfitted scorer's tensors are empty, and a fitted one's may be of another shape: take the saved shapes
        for name in (*_NETWORK, *_BUFFERS):
            if prefix + name in state_dict:
                empty = torch.empty_like(state_dict[prefix + name], device=getattr(self, name).device)
                setattr(self, name, nn.Parameter(empty) if name in _NETWORK else empty)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if self.fitted and self.sigmas_.numel():
            for name, value in saved.items():
                if not _same(value, getattr(self, name)):  # equal within float32: keep the exact float given
                    setattr(self, name, value)
            self._refresh_level_weights()

    # ---- scoring ----

    def forward(self, x: torch.Tensor, statistic: str | None = None,
                implementation: str | Sequence[str] | None = None) -> torch.Tensor:
        """``[B]`` scores of ``x [B, D]`` (float32; float64 for float64 ``x``) by the ``edm_score`` op;
        differentiable in ``x`` and in the weights (``score`` is the same without the weights' graph)."""
        self._require_fitted()
        statistic = _check_statistic(self.statistic if statistic is None else statistic)
        tensors = (self.mean_, self.inv_scale_, self.noise_, getattr(self, f"_{statistic}_weights"),
                   self.noise_embedding(self.sigmas_), self.w_in, self.w1, self.b1, self.w2, self.b2, self.w_out,
                   self.b_out)
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:  # the op takes float64 weights for float64 x
            tensors = [t.to(torch.float64) for t in tensors]
        return edm_score(x, *tensors, self._grid[0], self._grid[1], statistic, implementation)


def _same(a, b) -> bool:
    """Whether two configuration values agree (floats within the float32 rounding of the saved grid)."""
    return math.isclose(a, b, rel_tol=1e-6) if isinstance(a, float) or isinstance(b, float) else a == b


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

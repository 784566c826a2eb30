"""PyTorch Lightning: ``Trainer(strategy=SparseDDPStrategy(density=0.001))``.

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers a comm hook on CUDA only (on CPU
no hook is ever called, silently), needs the hook's state before the process group exists, and
saves none of it in its checkpoints. :class:`SparseDDPStrategy` registers microsparse's hook
itself on every device, saves every rank's hook state inside Lightning's checkpoints and
restores it on ``trainer.fit(ckpt_path=...)``, so a resumed run continues exactly, takes the
GradScaler of ``precision="16-mixed"``, and logs the step statistics through the trainer's
logger.

Example::

    trainer = pl.Trainer(strategy=SparseDDPStrategy(density=0.001), devices=4)
    trainer.fit(model)

For manual optimisation with a ``GradientReducer`` instead, see docs/FRAMEWORKS.md.
"""

from __future__ import annotations

from typing import Any

try:
    from pytorch_lightning.strategies import DDPStrategy
except ModuleNotFoundError as error:  # pragma: no cover - only without the extra
    raise ModuleNotFoundError(
        "microsparse.lightning needs PyTorch Lightning: pip install pytorch-lightning "
        "(or microsparse[frameworks])"
    ) from error

import torch

from microsparse.ddp import SparseState, sparse_hook
from microsparse.ranks import EveryRank

CHECKPOINT_KEY = "microsparse"
"""Where every rank's hook state lives inside a Lightning checkpoint."""
LOGGED = ("density", "ratio_error", "selected", "target", "bytes_sent", "traffic_ratio")
"""``StepStats`` fields logged as ``microsparse/<name>`` every ``log_every_n_steps``."""


class SparseDDPStrategy(DDPStrategy):
    """DDP with microsparse's comm hook: any sparsifier, on CPU (gloo) and CUDA (NCCL).

    Args:
        density: fraction of the gradient entries sent per step.
        sparsifier: a name from :func:`microsparse.available_sparsifiers`.
        value_dtype, timeout, nonfinite: as for :class:`microsparse.ddp.SparseState`.
        ddp_kwargs: keyword arguments of Lightning's ``DDPStrategy`` (e.g.
            ``{"find_unused_parameters": True}``).
        **options: options of the sparsifier, e.g. ``threshold_rule="as_coded"``, and the
            state's ``momentum_correction``, ``momentum_nesterov``, ``adam_correction``,
            ``density_warmup``, ``one_exchange`` and ``min_speedup``.

    The hook state is ``strategy.hook_state`` once the trainer has set the strategy up.
    """

    def __init__(
        self,
        density: float = 0.001,
        sparsifier: str = "micro",
        *,
        value_dtype: torch.dtype | None = None,
        timeout: float | None = None,
        nonfinite: str = "skip",
        ddp_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**(ddp_kwargs or {}))
        self._hook_arguments: dict[str, Any] = dict(
            sparsifier=sparsifier, density=density, value_dtype=value_dtype, timeout=timeout,
            nonfinite=nonfinite, **options,
        )  # fmt: skip
        SparseState(**self._hook_arguments)  # the options' errors, now, in the user's code
        self.hook_state: SparseState | None = None
        self._restored: dict[str, Any] | None = None

    def _register_ddp_hooks(self) -> None:
        scaler = getattr(self.precision_plugin, "scaler", None)  # "16-mixed"
        self.hook_state = SparseState(**self._hook_arguments, grad_scaler=scaler)
        if self._restored is not None:
            EveryRank(self.hook_state).load_state_dict(self._restored)
            self._restored = None
        assert self.model is not None
        self.model.register_comm_hook(self.hook_state, sparse_hook)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        # Called on every rank; the file is written by rank 0 only, so it must hold them all.
        if self.hook_state is not None:
            checkpoint[CHECKPOINT_KEY] = EveryRank(self.hook_state).state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        # Runs before the model is wrapped: the state is loaded when the hook is registered.
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restored = checkpoint.get(CHECKPOINT_KEY)
        return checkpoint

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        trainer = self.lightning_module.trainer if self.lightning_module else None
        stats = self.hook_state.last_step if self.hook_state is not None else None
        if trainer is None or stats is None or trainer.logger is None or not self.is_global_zero:
            return
        if trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            values = {f"microsparse/{name}": float(getattr(stats, name)) for name in LOGGED}
            trainer.logger.log_metrics(values, step=trainer.global_step)

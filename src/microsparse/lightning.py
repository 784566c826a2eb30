"""Lightning: ``Trainer(strategy=SparseDDPStrategy(density=0.001))``, from either package.

Lightning ships as two packages with the same code: ``lightning`` (imported as
``lightning.pytorch``, the one Lightning recommends) and ``pytorch-lightning`` (imported as
``pytorch_lightning``). A Trainer takes only strategies of its own package, so
:class:`SparseDDPStrategy` becomes the strategy of the package your program imported: write the
same line with either. If both are imported, it cannot tell which Trainer it is for and says
so; then name the package with :data:`LightningSparseDDPStrategy` (``lightning.pytorch``) or
:data:`PyTorchLightningSparseDDPStrategy` (``pytorch_lightning``).

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers a comm hook on CUDA only (on CPU
no hook is ever called, silently), needs the hook's state before the process group exists, and
saves none of it in its checkpoints. :class:`SparseDDPStrategy` registers microsparse's hook
itself on every device, saves every rank's hook state inside Lightning's checkpoints and
restores it on ``trainer.fit(ckpt_path=...)``, so a resumed run continues exactly, takes the
GradScaler of ``precision="16-mixed"``, and logs the step statistics through the trainer's
logger.

Example (``pip install lightning``)::

    import lightning.pytorch as pl
    from microsparse.lightning import SparseDDPStrategy

    trainer = pl.Trainer(strategy=SparseDDPStrategy(density=0.001), devices=4)
    trainer.fit(model)

Example (``pip install pytorch-lightning``)::

    import pytorch_lightning as pl
    from microsparse.lightning import SparseDDPStrategy

    trainer = pl.Trainer(strategy=SparseDDPStrategy(density=0.001), devices=4)
    trainer.fit(model)

For manual optimisation with a ``GradientReducer`` instead, see docs/FRAMEWORKS.md.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from typing import Any

import torch

from microsparse.ddp import SparseState, sparse_hook
from microsparse.ranks import EveryRank

__all__ = [
    "LightningSparseDDPStrategy",  # noqa: F822  (built by __getattr__ on first use)
    "PyTorchLightningSparseDDPStrategy",  # noqa: F822
    "SparseDDPStrategy",
]

PACKAGES = {
    "LightningSparseDDPStrategy": "lightning.pytorch",
    "PyTorchLightningSparseDDPStrategy": "pytorch_lightning",
}
"""The strategy class for each Lightning package, by its name in this module."""
CHECKPOINT_KEY = "microsparse"
"""Where every rank's hook state lives inside a Lightning checkpoint."""
LOGGED = ("density", "ratio_error", "selected", "target", "bytes_sent", "traffic_ratio")
"""``StepStats`` fields logged as ``microsparse/<name>`` every ``log_every_n_steps``."""


def _installed(package: str) -> bool:
    # The top-level name only: finding "lightning.pytorch" would import all of Lightning.
    return importlib.util.find_spec(package.split(".")[0]) is not None


if not any(_installed(package) for package in PACKAGES.values()):
    raise ModuleNotFoundError(
        "microsparse.lightning needs Lightning: pip install microsparse[frameworks] "
        "(or pip install lightning, or pytorch-lightning)"
    )


class SparseDDPStrategy:
    """DDP with microsparse's comm hook: any sparsifier, on CPU (gloo) and CUDA (NCCL).

    ``SparseDDPStrategy(...)`` is the strategy of the Lightning package the program imported,
    ``lightning.pytorch`` or ``pytorch_lightning`` (if neither yet, the one installed, preferring
    ``lightning``): an instance of this class and of that package's ``DDPStrategy``. To subclass
    it, or with both packages imported, use :data:`LightningSparseDDPStrategy` or
    :data:`PyTorchLightningSparseDDPStrategy`, which take the same arguments.

    Args:
        density: fraction of the gradient entries sent per step (unless ``budget`` is
            given instead, among the options; neither: what ``DEFAULT_BUDGET`` buys).
        sparsifier: a name from :func:`microsparse.available_sparsifiers`.
        value_dtype, timeout, nonfinite: as for :class:`microsparse.ddp.SparseState`.
        ddp_kwargs: keyword arguments of Lightning's ``DDPStrategy`` (e.g.
            ``{"find_unused_parameters": True}``).
        **options: options of the sparsifier, e.g. ``threshold_rule="as_coded"``, and the
            state's ``budget``, ``momentum_correction``, ``momentum_nesterov``, ``adam_correction``,
            ``density_warmup``, ``one_exchange``, ``own_thread`` and ``min_speedup``.

    The hook state is ``strategy.hook_state`` once the trainer has set the strategy up.
    """

    lightning_package: str | None = None
    """The Lightning package whose ``DDPStrategy`` this class extends (None: not chosen yet)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> SparseDDPStrategy:
        if cls is SparseDDPStrategy:
            cls = _strategy_class(_package_in_use())
        elif cls.lightning_package is None:
            raise TypeError(
                f"{cls.__name__} subclasses SparseDDPStrategy, which Lightning's Trainer does not "
                "take as it is: subclass microsparse.lightning.LightningSparseDDPStrategy (for "
                "lightning.pytorch) or PyTorchLightningSparseDDPStrategy (for pytorch_lightning)"
            )
        return super().__new__(cls)

    def __init__(
        self,
        density: float | None = None,
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


def _package_in_use() -> str:
    """The Lightning package this program imported, else the installed one."""
    imported = [package for package in PACKAGES.values() if package in sys.modules]
    if len(imported) > 1:
        raise RuntimeError(
            "SparseDDPStrategy: both lightning.pytorch and pytorch_lightning are imported, so "
            "which Trainer it is for is unknown; use microsparse.lightning."
            "LightningSparseDDPStrategy for lightning.pytorch's Trainer or "
            "PyTorchLightningSparseDDPStrategy for pytorch_lightning's (same arguments)"
        )
    if imported:
        return imported[0]
    return next(package for package in PACKAGES.values() if _installed(package))


@functools.cache
def _strategy_class(package: str) -> type[SparseDDPStrategy]:
    """:class:`SparseDDPStrategy` on ``package``'s ``DDPStrategy``, one class per package."""
    name = next(name for name, known in PACKAGES.items() if known == package)
    try:
        strategies = importlib.import_module(f"{package}.strategies")
    except ModuleNotFoundError as error:
        install = "lightning" if package == "lightning.pytorch" else "pytorch-lightning"
        raise ModuleNotFoundError(
            f"microsparse.lightning.{name} needs {package}: pip install {install} "
            "(or microsparse[frameworks])"
        ) from error
    # A module attribute under its own name (see __getattr__), so that its instances pickle,
    # as Lightning's spawn launcher does.
    namespace = {"__module__": __name__, "__doc__": SparseDDPStrategy.__doc__,
                 "lightning_package": package}  # fmt: skip
    return type(name, (SparseDDPStrategy, strategies.DDPStrategy), namespace)


def __getattr__(name: str) -> Any:
    # Imported on first use: importing Lightning takes seconds, and one package may be absent.
    if name in PACKAGES:
        return _strategy_class(PACKAGES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

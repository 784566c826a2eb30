"""What is kept back: error feedback over one flat residual vector."""

from microsparse.feedback.residual import (
    ErrorFeedback,
    Fresh,
    ResidualScale,
    any_nonfinite,
    check_adam,
    check_momentum,
)

__all__ = [
    "ErrorFeedback", "Fresh", "ResidualScale", "any_nonfinite", "check_adam", "check_momentum",
]

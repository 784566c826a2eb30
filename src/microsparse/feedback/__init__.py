"""What is kept back: error feedback over one flat residual vector."""

from microsparse.feedback.residual import (
    ErrorFeedback,
    Fresh,
    any_nonfinite,
    check_adam,
    check_momentum,
    flag_nonfinite,
)

__all__ = [
    "ErrorFeedback", "Fresh", "any_nonfinite", "check_adam", "check_momentum", "flag_nonfinite",
]

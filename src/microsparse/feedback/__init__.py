"""What is kept back: error feedback over one flat residual vector."""

from microsparse.feedback.residual import (
    NONFINITE,
    ErrorFeedback,
    Fresh,
    ResidualScale,
    any_nonfinite,
)

__all__ = ["NONFINITE", "ErrorFeedback", "Fresh", "ResidualScale", "any_nonfinite"]

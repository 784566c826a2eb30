"""What is kept back: error feedback over one flat residual vector."""

from microsparse.feedback.residual import ErrorFeedback

__all__ = ["ErrorFeedback"]

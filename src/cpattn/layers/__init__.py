"""Reference model layers built on cpattn (tests, examples, benchmarks; not tied to any engine)."""

from .attention_stack import AttentionStack, GQAAttentionLayer
from .rope import apply_rope

__all__ = ["AttentionStack", "GQAAttentionLayer", "apply_rope"]

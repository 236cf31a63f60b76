"""Reference model layers built on cpattn: RoPE, a GQA attention stack, DeepSeek-V3 MLA and DSA.

Used by the tests, examples and benchmarks; not tied to any engine and not installed with
cpattn: import it with the repository root on ``sys.path`` (pytest does so through
``pythonpath = ["."]``; the examples and ``benchmarks/run.py`` insert the root themselves).
"""

from .attention_stack import AttentionStack, GQAAttentionLayer
from .rope import apply_rope

__all__ = ["AttentionStack", "GQAAttentionLayer", "apply_rope"]

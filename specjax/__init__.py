"""specjax: RL post-training in JAX with lossless speculative-decoding rollouts."""

__version__ = "0.1.0"

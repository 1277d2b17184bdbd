"""DeepSeek-V4.1-Flash for MLX."""

__version__ = "0.1.0"

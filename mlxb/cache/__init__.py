"""Cache row operations over mlx-lm's single and batch caches (one protocol for every layer kind)."""

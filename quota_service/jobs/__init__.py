"""Background loops, each safe to run in every replica."""

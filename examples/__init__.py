"""Runnable examples of torchsso2 (see each script's --help)."""

"""Model definitions (plain-PyTorch reference path)."""

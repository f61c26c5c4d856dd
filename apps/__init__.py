"""Flower apps of flwr-verl: the ClientApp and ServerApp that `flwr run .` starts (see pyproject.toml)."""

"""Data files shipped with the gateway (read with importlib.resources, so they work installed)."""

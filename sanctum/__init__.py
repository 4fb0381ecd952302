"""The `sanctum` command line."""

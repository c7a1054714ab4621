"""C sources of the engine's native kernels (built at first use by native_attention.py)."""

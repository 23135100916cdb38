"""overdrive: one declarative config for a whole training run, passed into Accelerate."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load_config", "build_accelerator", "RunConfig"]


def __getattr__(name: str):
    # Lazy: `import overdrive` must stay cheap, the CLI imports it on every start.
    if name == "load_config":
        from overdrive.resolving import load_config

        return load_config
    if name == "RunConfig":
        from overdrive.config.schema import RunConfig

        return RunConfig
    if name == "build_accelerator":
        from overdrive.launch.process import build_accelerator

        return build_accelerator
    raise AttributeError(f"module 'overdrive' has no attribute {name!r}")

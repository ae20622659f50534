"""Typed config schema, loader and YAML presets (`configs/*.yaml`)."""

from configs.loader import ConfigError, load_config, save_config
from configs.schema import TetherConfig

__all__ = ["ConfigError", "TetherConfig", "load_config", "save_config"]

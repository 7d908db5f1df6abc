"""gw.hf: Hugging Face interop's public names (the code lives in gridweave/models/hf.py)."""
from .models.hf import config_from_hf, from_hf, from_pretrained, hf_config, hf_kind, read_config, save_hf, to_hf

__all__ = ["from_hf", "from_pretrained", "to_hf", "save_hf", "hf_config", "hf_kind", "config_from_hf", "read_config"]

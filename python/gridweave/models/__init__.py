"""Models: the dense GPT and Llama (dense.py), the dense model on a grid (stage.py) and Hugging
Face interop (hf.py; transformers is optional). The dense and grid modules never import hf."""
from .dense import IGNORE, Bert, GPT, Embedding, Head, Llama, ModelConfig, build
from .hf import from_hf, to_hf
from .stage import GPTStage, ModelChunks, parse_tp

__all__ = ["ModelConfig", "Embedding", "Head", "GPT", "Llama", "Bert", "IGNORE", "build", "from_hf", "to_hf", "GPTStage", "ModelChunks",
           "parse_tp"]

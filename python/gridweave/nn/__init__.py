"""Parallel modules: 1-D (Megatron), 2-D (SUMMA), 3-D (Bian et al.) and the layer."""
from ..autograd.vocab import vocab_parallel_cross_entropy
from .moe import DenseMoE, ExpertParallelMoE, MoE, Scoring
from .dense import (BERT, GPT2, LLAMA, MLA, Activation, Arch, DenseMLA, DenseMLP, DenseSelfAttention,
                    DenseTransformerLayer, Norm, attention)
from .tensor1d import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .tensor2d import LayerNorm2D, Linear2D
from .tensor3d import LayerNorm3D, Linear3D
from .sequence import ReplicatedLayerNorm, ReplicatedLinear, global_token_mean
from .subgraph import SubGraphAttention
from .transformer import MLP, RingAttention, RingSelfAttention, SelfAttention, TransformerLayer

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "Linear2D", "LayerNorm2D", "Linear3D", "LayerNorm3D", "SelfAttention", "MLP", "TransformerLayer", "DenseTransformerLayer", "DenseSelfAttention", "DenseMLP",
           "RingSelfAttention", "RingAttention", "ReplicatedLinear", "ReplicatedLayerNorm", "global_token_mean", "SubGraphAttention",
           "attention", "Arch", "Norm", "Activation", "GPT2", "LLAMA", "BERT", "MoE", "DenseMoE", "ExpertParallelMoE",
           "Scoring", "MLA", "DenseMLA"]


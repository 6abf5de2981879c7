"""Tiny random-weight models of issue 16's family matrix (tests/families/test_families_matrix.py).

Every matrix builder (named by family) takes no arguments (so that an exported script can name it as its
``factory``), seeds 0 and returns a model with random weights, no dropout and no KV cache: Gemma-3, Falcon
(``new_decoder_architecture`` with 2 KV heads, and the default multi-query config), BLOOM, Whisper, CLIP, Phi-3,
DeBERTa-v2, ResNet, GPT-J and Qwen2 from transformers configs (no hub access), plus two hand-written modules:
nanoGPT (its attention derives the head size from the input width, which no column-parallel preset can keep
right) and :class:`CustomLM`, a plain decoder with separate q/k/v/o ``nn.Linear`` layers and an MLP, which the
Megatron preset should shard right.

It also holds what the zoo's other modules share: :data:`DECODER` (the tiny decoder config, also
:mod:`zoo.pp`'s), :func:`decoder_cfg` (:mod:`zoo.tp`'s decoders) and the unseeded, parameterised ``*_model``
builders that ``tests/multirank/tp_train.py`` (and for Qwen3 / Mixtral ``pp_models.py``) import.
This module imports nothing from the other test modules: exported scripts import it as ``tests.zoo.matrix``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 128
BATCH, SEQ = 4, 8


def _seeded(fn):
    def build():
        torch.manual_seed(0)
        return fn()

    build.__name__ = fn.__name__
    build.__doc__ = fn.__doc__
    return build


# the tiny decoder config: 2 layers, hidden 64, 4 heads, vocab 128, no KV cache
DECODER = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "use_cache": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


def _decoder(cls, **kw):
    """``cls`` (a config class) of :data:`DECODER`; ``kw`` adds or overrides."""
    return cls(**{**DECODER, **kw})


def decoder_cfg(cls, **kw):
    """Issue 10's tiny decoder config (tp_train.py's ``_decoder_cfg``): :data:`DECODER` with 2 KV heads and
    untied embeddings (``kw`` overrides)."""
    return _decoder(cls, **{"num_key_value_heads": 2, "tie_word_embeddings": False, **kw})


# ------------------------------------------------- unseeded builders shared with tests/multirank (callers seed)
def whisper_model():
    """Whisper: an encoder stack and a decoder stack (with cross attention) -- the preset covers both."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=32,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        dropout=0.0,
        use_cache=False,
    )
    return WhisperForConditionalGeneration(cfg)


def deberta_v2_model(share_att_key: bool = False):
    """DeBERTa-v2 masked LM with disentangled relative attention (p2c + c2p): q/k/v are named *_proj, and
    the relative embeddings go through pos_key_proj / pos_query_proj (or key_proj / query_proj when shared)."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    cfg = DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
        share_att_key=share_att_key,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return DebertaV2ForMaskedLM(cfg)


def falcon_new_arch_model(heads: int = 4, kv_heads: int = 2):
    """Falcon with ``new_decoder_architecture``: the fused query_key_value is one [q x heads/kv, k, v] group
    per key/value head (sharded contiguously by groups)."""
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        new_decoder_architecture=True,
        num_kv_heads=kv_heads,
        use_cache=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return FalconForCausalLM(cfg)


def bloom_model():
    """BLOOM: per head [q, k, v] query_key_value and an ALiBi bias built by BloomModel for all heads."""
    from transformers import BloomConfig, BloomForCausalLM

    cfg = BloomConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        n_layer=2,
        n_head=4,
        use_cache=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return BloomForCausalLM(cfg)


def phi3_model(kv_heads: int = 4):
    """Phi-3: qkv_proj is [q; k; v] back to back (3 equal blocks, or unequal ones with fewer key/value heads),
    gate_up_proj is [gate; up]; Phi3Attention reads config.num_attention_heads at run time."""
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = _decoder(
        Phi3Config, num_key_value_heads=kv_heads, original_max_position_embeddings=64, resid_pdrop=0.0
    )
    return Phi3ForCausalLM(cfg)


def qwen3_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(decoder_cfg(Qwen3Config, head_dim=16))


def mixtral_model():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        decoder_cfg(MixtralConfig, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)
    )


# ------------------------------------------------------------------ the matrix's builders (seeded: 0)
@_seeded
def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = _decoder(Gemma3TextConfig, num_key_value_heads=2, head_dim=16, sliding_window=8)
    return Gemma3ForCausalLM(cfg)


@_seeded
def falcon_gqa():
    """Falcon with ``new_decoder_architecture`` and 2 key/value heads (``[q x 2, k, v]`` groups)."""
    return falcon_new_arch_model(heads=4, kv_heads=2)


@_seeded
def falcon_mqa():
    """Falcon's default config: multi-query attention (one key/value head shared by all heads)."""
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        use_cache=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return FalconForCausalLM(cfg)


@_seeded
def bloom():
    return bloom_model()


@_seeded
def whisper():
    return whisper_model()


@_seeded
def clip():
    from transformers import CLIPConfig, CLIPModel

    text = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": VOCAB,
        "max_position_embeddings": 16,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 1,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 16,
        "patch_size": 8,
    }
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


@_seeded
def phi3():
    return phi3_model(kv_heads=2)


@_seeded
def deberta_v2():
    return deberta_v2_model(share_att_key=True)


@_seeded
def resnet():
    from transformers import ResNetConfig, ResNetModel

    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    return ResNetModel(cfg)


@_seeded
def gptj():
    """GPT-J: attention and MLP in parallel off one LayerNorm, partial rotary, separate q/k/v/out projections."""
    from transformers import GPTJConfig, GPTJForCausalLM

    cfg = GPTJConfig(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        rotary_dim=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    return GPTJForCausalLM(cfg)


@_seeded
def qwen2():
    """Qwen2: grouped-query attention with biased q/k/v projections, tied input and output embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(_decoder(Qwen2Config, num_key_value_heads=2, tie_word_embeddings=True))


# ------------------------------------------------------------------------- hand-written modules
class _NanoAttention(nn.Module):
    """nanoGPT's attention: the head size comes from the input's width (``C // n_head``)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = nn.Linear(width, 3 * width), nn.Linear(width, width), heads

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class _NanoBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), _NanoAttention(width, heads)
        self.ln_2, self.mlp = nn.LayerNorm(width), nn.Sequential(nn.Linear(width, 4 * width), nn.GELU())
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(self.mlp(self.ln_2(x)))


class NanoGPT(nn.Module):
    """tests/unit/numeric/test_numeric_check.py's nanoGPT: returns the logits."""

    def __init__(self, vocab: int = VOCAB, width: int = 64, heads: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.h = nn.ModuleList([_NanoBlock(width, heads) for _ in range(layers)])
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        for b in self.h:
            x = b(x)
        return self.lm_head(x)


class _Attention(nn.Module):
    """Separate q/k/v/o projections; the head count is an attribute and the head size a constant."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, width // heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.o_proj = nn.Linear(width, width)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (
            p(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class _MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(width, 4 * width)
        self.down_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = nn.LayerNorm(width), _Attention(width, heads)
        self.post_attention_layernorm, self.mlp = nn.LayerNorm(width), _MLP(width)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class CustomLM(nn.Module):
    """A hand-written decoder the Megatron preset should shard right: an embedding, blocks of separate
    q/k/v/o projections (head size fixed at construction) and an up/down MLP, a final norm and an LM head."""

    def __init__(self, vocab: int = VOCAB, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([_Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for b in self.layers:
            x = b(x)
        return self.lm_head(self.norm(x))


@_seeded
def nanogpt():
    return NanoGPT()


@_seeded
def custom():
    return CustomLM()

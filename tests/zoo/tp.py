"""The tiny models of the two-rank tensor-parallel runs (``tests/multirank/tp_train.py`` and the single-process
tests that reuse its cases).

Unseeded builders (the runner seeds before each one) of real transformers models from their config classes (no hub
access), mostly 2 blocks of hidden 32 with 4 heads, vocab 128, no dropout, no KV cache: BERT (and its MLM with the
tied decoder), GPT-2 (and one whose vocabulary does not divide by the world size), Llama (GQA; and 8 query / 2
key-value heads for more ranks than key/value heads), RoBERTa, OPT (and OPT-350M's layout), GPT-Neo, T5 / MT5 /
UMT5, Mistral, Gemma-3, Qwen3-MoE (and 30B-A3B's attention shape), ALBERT, ViT, Falcon without multi-query
attention (with or without ALiBi) and Phi-3 with GQA. The decoders share :func:`zoo.matrix.decoder_cfg`.
"""

from __future__ import annotations

from zoo.matrix import VOCAB, phi3_model
from zoo.matrix import decoder_cfg as _decoder_cfg


def bert_model():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertModel(cfg)


def bert_mlm_model():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(cfg)


def gpt2_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return GPT2LMHeadModel(cfg)


def gpt2_odd_vocab_model():
    """GPT-2 whose vocabulary (VOCAB + 1) does not divide by the world size: the preset keeps wte replicated."""
    model = gpt2_model()
    return type(model)(type(model.config)(**{**model.config.to_dict(), "vocab_size": VOCAB + 1}))


def llama_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


def llama_kv2_model():
    """Llama with 8 query heads and 2 key/value heads: at tp 4 (or 8) each key/value head is replicated on 2
    (4) ranks (issue 16 item 3, "more TP ranks than KV heads")."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(_decoder_cfg(LlamaConfig, num_attention_heads=8, head_dim=8))


def roberta_mlm_model():
    from transformers import RobertaConfig, RobertaForMaskedLM

    cfg = RobertaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=40,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    return RobertaForMaskedLM(cfg)


def opt_model(**kw):
    """OPT; ``word_embed_proj_dim=16, do_layer_norm_before=False`` gives OPT-350M's layout (narrower embeddings
    with project_in / project_out, post-norm blocks)."""
    from transformers import OPTConfig, OPTForCausalLM

    kw = {"word_embed_proj_dim": 32, **kw}
    cfg = OPTConfig(
        num_hidden_layers=2,
        hidden_size=32,
        ffn_dim=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
        use_cache=False,
        **kw,
    )
    return OPTForCausalLM(cfg)


def gpt_neo_model():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    cfg = GPTNeoConfig(
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
        embed_dropout=0.0,
        attention_dropout=0.0,
        resid_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return GPTNeoForCausalLM(cfg)


def t5_model(ff: str = "relu", variant: str = "T5"):
    """T5 (or its copies ``variant="MT5"`` / ``"UMT5"``, whose every layer has its own relative bias), with the
    LM head tied to the shared embedding (T5's default; the decoder output is scaled by d_model ** -0.5)."""
    import transformers

    config_cls, model_cls = (
        getattr(transformers, f"{variant}{n}") for n in ("Config", "ForConditionalGeneration")
    )
    cfg = config_cls(
        num_layers=2,
        num_decoder_layers=2,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_heads=4,
        vocab_size=VOCAB,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        feed_forward_proj=ff,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        use_cache=False,
        tie_word_embeddings=True,
    )
    return model_cls(cfg)


def mistral_model():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(_decoder_cfg(MistralConfig))


def gemma3_model():
    """Gemma-3's word embedding scales its lookup by sqrt(hidden) (``Gemma3TextScaledWordEmbedding``): the
    vocab-parallel forward must keep that scale (it dropped it: logits off by 0.187)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(_decoder_cfg(Gemma3TextConfig, head_dim=16, sliding_window=8))


def qwen3_moe_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(
        _decoder_cfg(
            Qwen3MoeConfig, head_dim=16, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2
        )
    )


def qwen3_moe_kv2_model():
    """Qwen3-MoE shaped like 30B-A3B's attention in small: 8 query heads, 2 key/value heads (per-head q/k norms),
    so tp 4 replicates each key/value head on 2 ranks."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(
        _decoder_cfg(
            Qwen3MoeConfig,
            num_attention_heads=8,
            head_dim=8,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )


def albert_model():
    from transformers import AlbertConfig, AlbertForMaskedLM

    return AlbertForMaskedLM(
        AlbertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            embedding_size=32,
            intermediate_size=128,
            num_attention_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout_prob=0.0,
        )
    )


def vit_model():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(
        ViTConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
            num_labels=10,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def falcon_old_layout_model(alibi: bool = False):
    """Falcon without multi-query attention: query_key_value is per head [q, k, v] (sharded by heads); with
    ``alibi`` the model folds a per-head bias into the attention mask (each rank takes its heads' slice)."""
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(
        FalconConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query=False,
            alibi=alibi,
            use_cache=False,
        )
    )


def phi3_gqa_model():
    return phi3_model(kv_heads=2)

"""The configuration of a Transformer-VQ model exported by tvq
(`tvq export --format hf`): the `[model]` settings of the run that trained
it, under tvq's names (docs/configs.md), and the ids of its special tokens.
"""

from transformers import PreTrainedConfig


class TvqConfig(PreTrainedConfig):
    """Symbols as tvq's: D = d_model, K = d_k, V = d_v, S = n_code,
    H = n_head, L = block_len, N = n_layer (2 N GAU sublayers)."""

    model_type = "tvq"
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    }

    vocab_size: int = 259
    d_model: int = 128
    d_k: int = 32
    d_v: int = 256
    n_code: int = 64
    n_head: int = 1
    n_layer: int = 2
    block_len: int = 64
    # "toeplitz" or "xl" (the export refuses "rotary").
    bias: str = "toeplitz"
    toeplitz_locality: float = 2.0
    sinusoid_base: float = 100000.0
    # Keys the compressed cache weighs at most as (None: the paper's cache).
    cache_limit: int | None = None
    # Keys one code weighs at most as (None: every key in full).
    code_limit: int | None = None
    # "fixed" (w = 1) or "learned" (w = 2 sigmoid(x W_w) per query and head).
    count_weight: str = "fixed"
    # "quantized" (the paper's) or "exact": the keys the two-block window scores.
    window_keys: str = "quantized"
    # "vq" (the export refuses "quadratic").
    attention: str = "vq"
    final_norm: bool = False
    tie_embeddings: bool = False
    logit_scale: float = 1.0
    # tvq's vocabulary ("bytes+3" or its tokenizer's hash) and the step the
    # weights are from.
    tvq_vocab: str = "bytes+3"
    tvq_step: int = 0
    use_cache: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | None = 1
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = False

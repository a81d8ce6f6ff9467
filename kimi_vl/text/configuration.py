"""`KimiTextConfig`: the Kimi language backbone: the Kimi-Linear hybrid (KDA + NoPE MLA, MoE feed-forward) and, as a
configuration of the same classes, the DeepSeek-V3 / Kimi K2 family (RoPE MLA, low-rank queries, grouped routing)."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..errors import ConfigError
from .rope import check_rope_parameters

LAYER_TYPES = ("kda", "mla", "mla_rope")
MLA_TYPES = ("mla", "mla_rope")
RESIDUALS = ("standard", "attnres", "block_attnres")
KIMI_TOKEN_IDS = {"pad_token_id": 163839, "bos_token_id": 163584, "eos_token_id": 163586}
"""The special-token ids of Kimi's tokenizer: `KimiTextConfig`'s defaults where `vocab_size` holds them."""


def default_layer_types(num_hidden_layers: int, mla_every: int = 4) -> list[str]:
    """The 3:1 hybrid: every `mla_every`-th layer (1-based) is MLA, the others KDA."""
    return ["mla" if (i + 1) % mla_every == 0 else "kda" for i in range(num_hidden_layers)]


class KimiTextConfig(PretrainedConfig):
    r"""Configuration of `KimiTextModel` / `KimiTextForCausalLM` (model_type `kimi_vl_text`).

    Sizes and names follow the released Kimi-Linear `config.json` where they exist (DeepSeek-V3's for the fields
    only that family uses). A DeepSeek-V3 / Kimi K2 text model is `layer_types=["mla_rope"] * n` with its
    `rope_parameters`, `q_lora_rank`, `n_group`/`topk_group`, `first_k_dense` (alias `first_k_dense_replace`) and
    `residual="standard"` (or `"block_attnres"`: equal at zero pseudo-queries); see `kimi_vl.convert.convert_kimi_k25`.

    Args:
        vocab_size: number of tokens.
        hidden_size: width of the residual stream.
        intermediate_size: width of the dense SwiGLU feed-forward (the first `first_k_dense` layers).
        num_hidden_layers: number of decoder layers (each = one mixer sublayer + one FFN sublayer).
        layer_types: per layer, `"kda"` (Kimi Delta Attention), `"mla"` (NoPE multi-head latent attention, as in
            Kimi-Linear) or `"mla_rope"` (MLA with rotary embedding on the `qk_rope_head_dim` slice, as in
            DeepSeek-V3 / Kimi K2); any mix. Default: the 3:1 hybrid, every 4th layer MLA.
        num_attention_heads: MLA heads.
        q_lora_rank: low-rank query compression of MLA (`None`: a full `q_proj`, as in Kimi-Linear).
        kv_lora_rank: MLA latent width (what the cache stores, with `qk_rope_head_dim`).
        qk_nope_head_dim: per-head key/query width expanded from the latent.
        qk_rope_head_dim: width of the key slice shared by all heads (and of each query head's matching slice):
            never rotated in `"mla"` layers, rotated in `"mla_rope"` layers.
        v_head_dim: per-head value width.
        mla_kv_norm_eps: eps of the latent RMSNorm and of the low-rank query RMSNorm (1e-6 in the released code and
            in DeepSeek-V3, independent of `rms_norm_eps`).
        attention_bias: biases on MLA's `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` (DeepSeek-V3's
            `attention_bias`; `q_proj`, `q_b_proj` and `kv_b_proj` never have one). Default False.
        rope_parameters: rotary embedding of `"mla_rope"` layers, with transformers' names: `rope_type`
            (`"default"`, `"linear"`, `"yarn"` as in DeepSeek-V3 / Kimi K2, `"llama3"`), `rope_theta` and the
            type's fields (`factor`, `original_max_position_embeddings`, `beta_fast`, `beta_slow`, `mscale`,
            `mscale_all_dim`, `attention_factor`, ...; see `kimi_vl.text.rope`). Legacy `rope_theta` /
            `rope_scaling` keys are accepted. With `mscale_all_dim` on a scaled type the softmax scale of
            `"mla_rope"` layers is multiplied by YaRN's `mscale**2`, as in DeepSeek-V3. Ignored by `"kda"` and
            `"mla"` layers. Default `{"rope_type": "default", "rope_theta": 10000.0}`.
        max_position_embeddings: the context length the rotary embedding is configured for: the default
            `original_max_position_embeddings` of scaled rope types and YaRN's `factor` when that is None. It does
            not limit the sequence length. Default None (none declared; NoPE layers need none).
        kda_num_heads, kda_head_dim: KDA heads and their key/value width.
        short_conv_kernel_size: kernel of the depthwise causal conv on q/k/v of KDA layers.
        num_experts: routed experts per MoE layer.
        num_experts_per_tok: experts chosen per token (top-k).
        num_shared_experts: always-on experts (one SwiGLU of width `moe_intermediate_size * num_shared_experts`;
            0: none).
        moe_intermediate_size: width of each expert.
        routed_scaling_factor: multiplier of the (renormalised) routed weights.
        norm_topk_prob: renormalise the top-k weights to sum to one.
        n_group, topk_group: DeepSeek-V3 group-limited routing: experts split into `n_group` groups, each scored by
            the sum of its two best biased scores, the top `topk_group` groups kept, top-k chosen within them
            (1/1 = off, as in Kimi-Linear).
        router_biased_weights: take the expert weights from the *biased* scores `sigmoid + e_score_correction_bias`
            (the released remote code, by accident of an aliased view) instead of the unbiased sigmoid scores
            (DeepSeek-V3, vLLM, transformers' `kimi_linear`). Default `False`: the transformers behaviour.
        first_k_dense: number of leading layers with a dense SwiGLU instead of MoE (DeepSeek-V3's
            `first_k_dense_replace`, accepted as an alias).
        rms_norm_eps: eps of every other RMSNorm.
        residual: `"block_attnres"` (default: Block Attention Residuals, from the first training step),
            `"attnres"` (Full AttnRes, every sublayer output a source) or `"standard"` (PreNorm sum).
        attnres_block_size: sublayers per AttnRes block (attention and FFN count separately); 6 as in the
            48B Kimi-Linear AttnRes run (9 blocks + the embedding over 54 sublayers).
        initializer_range: std of the normal init of linear and embedding weights.
        tie_word_embeddings: share the input embedding with the LM head.
        pad_token_id, bos_token_id, eos_token_id: special-token ids; default Kimi's tokenizer's (`KIMI_TOKEN_IDS`),
            or None where `vocab_size` does not hold them.
    """

    model_type = "kimi_vl_text"
    keys_to_ignore_at_inference = ["cache"]
    attribute_map = {"first_k_dense_replace": "first_k_dense"}

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 2304,
        intermediate_size: int = 9216,
        num_hidden_layers: int = 27,
        layer_types: list[str] | None = None,
        num_attention_heads: int = 32,
        q_lora_rank: int | None = None,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_kv_norm_eps: float = 1e-6,
        attention_bias: bool = False,
        rope_parameters: dict | None = None,
        max_position_embeddings: int | None = None,
        kda_num_heads: int = 32,
        kda_head_dim: int = 128,
        short_conv_kernel_size: int = 4,
        num_experts: int = 256,
        num_experts_per_tok: int = 8,
        num_shared_experts: int = 1,
        moe_intermediate_size: int = 1024,
        routed_scaling_factor: float = 2.446,
        norm_topk_prob: bool = True,
        n_group: int = 1,
        topk_group: int = 1,
        router_biased_weights: bool = False,
        first_k_dense: int = 1,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-5,
        residual: str = "block_attnres",
        attnres_block_size: int = 6,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = KIMI_TOKEN_IDS["pad_token_id"],
        bos_token_id: int | None = KIMI_TOKEN_IDS["bos_token_id"],
        eos_token_id: int | list[int] | None = KIMI_TOKEN_IDS["eos_token_id"],
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_kv_norm_eps = mla_kv_norm_eps
        self.attention_bias = attention_bias
        # Set before the base __init__, which standardises `rope_parameters` as for transformers' own configs (legacy
        # `rope_theta` / `rope_scaling` kwargs, yarn's `original_max_position_embeddings` default).
        self.max_position_embeddings = max_position_embeddings
        # (`rope_theta` falls back to a legacy `rope_theta` kwarg, else transformers' default 10000.)
        self.rope_parameters = dict(rope_parameters) if rope_parameters else {"rope_type": "default"}
        self.kda_num_heads = kda_num_heads
        self.kda_head_dim = kda_head_dim
        self.short_conv_kernel_size = short_conv_kernel_size
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = norm_topk_prob
        self.n_group = n_group
        self.topk_group = topk_group
        self.router_biased_weights = router_biased_weights
        self.first_k_dense = first_k_dense
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.residual = residual
        self.attnres_block_size = attnres_block_size
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        # Kimi's ids outside a smaller vocabulary (a config of one's own) name no token: none, not an invalid id
        ids = {name: None if value == KIMI_TOKEN_IDS[name] and value >= vocab_size else value
               for name, value in (("pad_token_id", pad_token_id), ("bos_token_id", bos_token_id),
                                   ("eos_token_id", eos_token_id))}
        try:
            super().__init__(
                **ids,
                tie_word_embeddings=tie_word_embeddings,
                **kwargs,
            )
        except (KeyError, TypeError, ValueError) as e:  # transformers' validators (e.g. rope_parameters' keys)
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"invalid KimiTextConfig: {e}") from e
        # Set after the base __init__, whose validators only know transformers' own layer-type vocabulary.
        self.layer_types = list(layer_types) if layer_types is not None else default_layer_types(num_hidden_layers)
        self.check_architecture()

    def validate(self) -> None:
        """transformers' config validators, except its `layer_types` vocabulary (ours is "kda"/"mla"/"mla_rope"), plus
        `check_architecture`."""
        for validator in getattr(type(self), "__class_validators__", []):
            if validator.__name__ != "validate_layer_type":
                validator(self)
        self.check_architecture()

    def _validate_yarn_rope_parameters(self, rope_parameters: dict, ignore_keys: set[str] | None = None) -> None:
        """transformers' yarn check divides by `max_position_embeddings`, which ours may leave unset (None); ours
        (`check_rope_parameters`, run by `check_architecture`) covers that case."""
        if self.max_position_embeddings is not None:
            super()._validate_yarn_rope_parameters(rope_parameters, ignore_keys=ignore_keys)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_sublayers(self) -> int:
        """Attention and FFN count separately (the unit of AttnRes blocks)."""
        return 2 * self.num_hidden_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense and self.num_experts > 0

    def check_architecture(self) -> None:
        """Raise `ConfigError` with a fix-it message for any inconsistent field."""
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}; "
                f"give one of {LAYER_TYPES} per layer (or leave layer_types unset for the 3:1 hybrid)."
            )
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ConfigError(f"layer_types contains {bad}; each entry must be one of {LAYER_TYPES}.")
        if "mla_rope" in self.layer_types:
            check_rope_parameters(self.rope_parameters or {}, self.qk_rope_head_dim, self.max_position_embeddings)
        if self.num_experts > 0 and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and num_experts={self.num_experts}."
            )
        if self.num_experts > 0 and (self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group):
            raise ConfigError(
                f"n_group={self.n_group} must divide num_experts={self.num_experts} and "
                f"1 <= topk_group={self.topk_group} <= n_group."
            )
        if self.num_experts > 0 and self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ConfigError(f"grouped routing scores each group by its two best experts: num_experts="
                              f"{self.num_experts} / n_group={self.n_group} leaves fewer than 2 per group.")
        per_group = self.num_experts // self.n_group if self.num_experts > 0 else 0
        if self.num_experts_per_tok > self.topk_group * per_group > 0:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} experts cannot come from the topk_group="
                              f"{self.topk_group} kept groups of {per_group} experts: raise topk_group or lower "
                              "num_experts_per_tok.")
        if self.num_shared_experts < 0 or self.first_k_dense < 0:
            raise ConfigError(f"num_shared_experts={self.num_shared_experts} and first_k_dense={self.first_k_dense} "
                              "must be >= 0.")
        if self.residual not in RESIDUALS:
            raise ConfigError(f"residual={self.residual!r}; choose one of {RESIDUALS}.")
        if self.attnres_block_size < 1:
            raise ConfigError(f"attnres_block_size={self.attnres_block_size} must be >= 1 (counted in sublayers).")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r}: only 'silu' (SwiGLU) is supported.")
        if self.short_conv_kernel_size < 1:
            raise ConfigError(f"short_conv_kernel_size={self.short_conv_kernel_size} must be >= 1.")
        for name in ("hidden_size", "num_hidden_layers", "vocab_size", "kda_num_heads", "kda_head_dim",
                     "num_attention_heads", "kv_lora_rank", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be a positive integer.")

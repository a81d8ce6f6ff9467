"""The hybrid decoder: `KimiTextModel` and `KimiTextForCausalLM` (PreTrainedModel + GenerationMixin)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import can_return_tuple

from ..activation_checkpointing import run_checkpointed
from ..errors import ConfigError, ShapeError
from ..offloading import RefusesOffloading
from .attnres import AttnResidual
from .cache import HybridCacheGenerationMixin, KimiHybridCache
from .configuration import KimiTextConfig
from .kda import KimiDeltaAttention, padding_runs_packed
from .mla import MultiHeadLatentAttention
from .moe import Experts, MoE, SwiGLU, TopKRouter
from .norm import RMSNorm
from .residual import StandardResidual
from .rope import RotaryEmbedding, packed_positions


class KimiDecoderLayer(nn.Module):
    """One layer = two sublayers: `attention` (KDA, NoPE MLA or RoPE MLA) and `feed_forward` (dense SwiGLU or MoE),
    each PreNorm: it normalises its input and returns only its output; the residual stream adds it."""

    def __init__(self, config: KimiTextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = (
            KimiDeltaAttention(config, layer_idx)
            if self.layer_type == "kda"
            else MultiHeadLatentAttention(config, layer_idx)
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MoE(config) if config.is_moe_layer(layer_idx) else SwiGLU(config.hidden_size,
                                                                            config.intermediate_size)

    def attention(
        self,
        h: torch.Tensor,
        padding_mask: torch.Tensor | None,
        mla_mask: torch.Tensor | None,
        cache: KimiHybridCache | None,
        cu_seqlens: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        packed_padding: bool | None = None,
    ) -> torch.Tensor:
        """`rope`: cos, sin of the tokens' positions, read by `"mla_rope"` layers only; `packed_padding`: how KDA
        layers treat `padding_mask` (`padding_runs_packed`, decided once per forward)."""
        x = self.input_layernorm(h)
        if self.layer_type == "kda":
            return self.self_attn(x, padding_mask=padding_mask, cache=cache, cu_seqlens=cu_seqlens,
                                  packed_padding=packed_padding)
        return self.self_attn(x, attn_mask=mla_mask, cache=cache, cu_seqlens=cu_seqlens,
                              rope=rope if self.layer_type == "mla_rope" else None)

    def feed_forward(self, h: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`token_mask [B, T]`: the real tokens, the only ones an MoE router counts in its expert load."""
        x = self.post_attention_layernorm(h)
        return self.mlp(x, token_mask) if isinstance(self.mlp, MoE) else self.mlp(x)


class KimiTextPreTrainedModel(RefusesOffloading, PreTrainedModel):
    config_class = KimiTextConfig
    config: KimiTextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    # The residual stream calls each layer's mixer and FFN directly (`layer.attention`, `layer.feed_forward`), not
    # `layer.forward`: these are the units FSDP2 / device_map hooks must wrap.
    _no_split_modules = ["KimiDeltaAttention", "MultiHeadLatentAttention", "MoE", "SwiGLU"]
    _supports_sdpa = True
    _is_stateful = True
    # The router's balancing bias stays fp32 in a bf16 model, as in transformers' kimi_linear / deepseek_v3. Unlike
    # there, the router weight `gate.weight` (fp32 in both) and KDA's `dt_bias` (fp32 in kimi_linear) take the model's
    # dtype: the router and the decay compute in fp32 from the rounded values.
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Conv1d):
            init.kaiming_uniform_(module.weight, a=5**0.5)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:  # MLA with attention_bias
                init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, TopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
            init.zeros_(module.expert_load)  # non-persistent: from_pretrained would leave it uninitialised
        elif isinstance(module, Experts):
            for w in (module.w1, module.w2, module.w3):
                init.normal_(w, mean=0.0, std=std)
        elif isinstance(module, AttnResidual):
            for q in [*module.queries, module.final_query]:
                init.zeros_(q)
            for g in [*module.key_norms, module.final_key_norm]:
                init.ones_(g)
        elif isinstance(module, KimiDeltaAttention):
            h = module.A_log.shape[2]
            init.copy_(module.A_log, torch.empty(1, 1, h, 1).uniform_(1.0, 16.0).log())
            dt = torch.empty(module.dt_bias.shape).uniform_(-6.907755, -2.302585).exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt), dt ~ logU(1e-3, 0.1)


def build_residual(config: KimiTextConfig) -> StandardResidual | AttnResidual:
    """The residual stream chosen by `config.residual`."""
    if config.residual == "standard":
        return StandardResidual()
    block = 1 if config.residual == "attnres" else config.attnres_block_size
    return AttnResidual(config.hidden_size, config.num_sublayers, block, eps=config.rms_norm_eps)


def build_mla_mask(
    attention_mask: torch.Tensor | None, num_new: int, num_total: int
) -> torch.Tensor | None:
    """Boolean `[B, 1, T, L]` mask (True = attend) for T new tokens after `L - T` cached ones, from a 2-D padding
    mask `[B, L]`; None when plain causal attention is enough. Every row keeps its own position so fully padded
    query rows stay finite (their outputs are never read)."""
    T, L = num_new, num_total
    padded = attention_mask is not None and not bool(attention_mask.all())
    if not padded and (T == L or T == 1):
        return None
    device = attention_mask.device if attention_mask is not None else None
    causal = torch.ones(T, L, dtype=torch.bool, device=device).tril(L - T)
    if not padded:
        return causal[None, None]
    valid = attention_mask[:, -L:].bool()[:, None, None, :]
    own = torch.zeros(T, L, dtype=torch.bool, device=device)
    own[torch.arange(T), torch.arange(L - T, L)] = True
    return (causal & valid) | own


def one_cache(cache: KimiHybridCache | None, past_key_values: KimiHybridCache | None) -> KimiHybridCache | None:
    """The cache a forward continues: `cache`, or `past_key_values` (transformers' name for it, which
    `outputs.past_key_values` reads back), the same object when both are given. Another kind of cache (e.g.
    transformers' `DynamicCache`, which has no KDA state) is refused."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ConfigError("Pass the cache as `cache` or as `past_key_values` (the same argument), not two caches.")
    cache = cache if cache is not None else past_key_values
    if cache is not None and not isinstance(cache, KimiHybridCache):
        raise ConfigError(f"a {type(cache).__name__} cannot hold this model's inference state (KDA recurrent states "
                          "and MLA latents): pass a KimiHybridCache(model.config.get_text_config()), or no cache and "
                          "let the forward or generate() create one (outputs.cache returns it).")
    return cache


def refuse_attention_outputs(kwargs: dict, config: PretrainedConfig) -> None:
    """`output_attentions=True` (the argument, or when not given `config.output_attentions`, as transformers' models
    read it, e.g. set by `from_pretrained(..., output_attentions=True)`) has nothing to return: the KDA layers form
    no attention matrix and the MLA layers run fused attention. Refused rather than answered with None."""
    if kwargs.get("output_attentions") or (kwargs.get("output_attentions") is None and config.output_attentions):
        raise ConfigError("output_attentions=True is not supported: KDA layers form no attention matrix and MLA "
                          "layers run fused attention; output_hidden_states=True gives every layer's hidden states. "
                          "Pass output_attentions=False or set model.config.output_attentions = False.")


class KimiTextModel(KimiTextPreTrainedModel):
    """Embeddings, the hybrid decoder layers, the residual stream and the final norm.

    Shapes: `input_ids [B, T]` -> `last_hidden_state [B, T, hidden]`.
    """

    def __init__(self, config: KimiTextConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KimiDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.residual = build_residual(config)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = (
            RotaryEmbedding(config.rope_parameters, config.qk_rope_head_dim, config.max_position_embeddings)
            if "mla_rope" in config.layer_types
            else None
        )
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: KimiHybridCache | None = None,
        past_key_values: KimiHybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        token_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """`cu_seqlens` `[N+1]` packs N independent sequences in a batch of 1.

        `token_mask` `[B, T]` (bool) marks the real tokens, the only ones the MoE routers count in their expert loads
        in training forwards (aux-loss-free balancing); by default (`real_tokens`) the tokens `attention_mask` keeps
        that are not `pad_token_id`.

        `position_ids` `[B or 1, T]` are read by `"mla_rope"` layers only (KDA's conv and decay and NoPE MLA carry
        order without them). When not given they are derived: restarting at 0 in each packed sequence with
        `cu_seqlens`; from the 2-D `attention_mask` (`cumsum - 1`, so left padding does not shift a row's positions,
        the rule `generate` uses); else `cached + 0..T-1`.

        `output_hidden_states` (default `config.output_hidden_states`, as in transformers' models): `hidden_states`
        holds `num_hidden_layers + 1` tensors `[B, T, hidden]`, each layer's input stream and the final normed
        output."""
        refuse_attention_outputs(kwargs, self.config)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        cache = one_cache(cache, past_key_values)
        if (input_ids is None) == (inputs_embeds is None):
            raise ShapeError("Pass exactly one of input_ids [B, T] or inputs_embeds [B, T, hidden].")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        if T == 0:
            raise ShapeError(f"the input has no tokens (shape [{B}, 0]); pass at least one token per row.")
        if cu_seqlens is not None and (B != 1 or attention_mask is not None or cache is not None):
            raise ShapeError(
                f"cu_seqlens packs sequences into one row: it needs batch size 1 (got {B}), no attention_mask "
                "and no cache."
            )
        if use_cache is None:  # a cache is for inference: training forwards do not build one unless asked
            use_cache = self.config.use_cache and not self.training
        if use_cache and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # (without gradients nothing is recomputed: `generate` in train mode, as TRL's trainers call it, works)
            raise ConfigError("use_cache=True cannot be combined with gradient checkpointing during training "
                             "(recomputation would append to the cache twice); pass use_cache=False.")
        if use_cache and cache is None and cu_seqlens is None:
            cache = KimiHybridCache(self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None and attention_mask.shape != (B, past + T):
            raise ShapeError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; expected (batch, cached + new tokens) = "
                f"({B}, {past + T})."
            )
        padding_mask = None
        if attention_mask is not None and not bool(attention_mask[:, -T:].all()):
            padding_mask = attention_mask[:, -T:]
        mla_mask = build_mla_mask(attention_mask, T, past + T)
        if token_mask is None and self.training:
            token_mask = real_tokens(input_ids, attention_mask, self.config.pad_token_id, T)
        rope = None
        if self.rotary is not None:
            positions = self.positions(position_ids, attention_mask, cu_seqlens, past, T, inputs_embeds.device)
            rope = self.rotary(positions, inputs_embeds.dtype)

        packed_padding = None  # every KDA layer treats the padding alike: decided here, with one read of the mask
        if padding_mask is not None and any(layer.layer_type == "kda" for layer in self.layers):
            packed_padding = padding_runs_packed(padding_mask, past > 0, cache is not None)
        hidden_states = [] if output_hidden_states else None
        state = self.residual.begin(inputs_embeds)
        for i, layer in enumerate(self.layers):
            h = self.residual.read(state, 2 * i)
            if hidden_states is not None:
                hidden_states.append(h)
            out = run_checkpointed(self, layer.attention, h, padding_mask, mla_mask, cache, cu_seqlens, rope,
                                   packed_padding)
            state = self.residual.write(state, 2 * i, out)
            out = run_checkpointed(self, layer.feed_forward, self.residual.read(state, 2 * i + 1), token_mask)
            state = self.residual.write(state, 2 * i + 1, out)
        h = self.norm(self.residual.end(state))
        if hidden_states is not None:
            hidden_states.append(h)
        if cache is not None:
            cache.advance(T)
        return BaseModelOutputWithPast(
            last_hidden_state=h,
            cache=cache if use_cache else None,
            hidden_states=tuple(hidden_states) if hidden_states is not None else None,
        )

    @staticmethod
    def positions(
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        past: int,
        T: int,
        device: torch.device,
    ) -> torch.Tensor:
        """Token positions `[B or 1, T]` for the rotary embedding (see `forward`)."""
        if position_ids is not None:
            if position_ids.shape[-1] != T:
                raise ShapeError(f"position_ids have shape {tuple(position_ids.shape)}; expected (batch, {T}).")
            return position_ids.to(device).reshape(-1, T)
        if cu_seqlens is not None:
            return packed_positions(cu_seqlens.to(device), T)
        if attention_mask is not None:
            return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -T:].to(device)
        return torch.arange(past, past + T, device=device)[None]

    def cache_bytes_per_token(self, num_tokens: int, dtype: torch.dtype | None = None) -> float:
        """Inference-cache bytes per token of one sequence of `num_tokens` tokens: KDA layers hold a fixed fp32
        state and conv tail (amortised over the tokens), MLA layers `kv_lora_rank + qk_rope_head_dim` values per
        token in `dtype` (default: the model's dtype)."""
        cfg = self.config
        size = torch.finfo(dtype or self.dtype).bits // 8
        kda_fixed = (cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4
                     + 3 * cfg.kda_num_heads * cfg.kda_head_dim * (cfg.short_conv_kernel_size - 1) * size)
        mla_per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * size
        n_kda = cfg.layer_types.count("kda")
        n_mla = cfg.layer_types.count("mla") + cfg.layer_types.count("mla_rope")
        return n_kda * kda_fixed / num_tokens + n_mla * mla_per_token

    def reset_expert_loads(self) -> None:
        """Zero every router's expert-load counter. Training entry points call this: `expert_load` is a
        non-persistent buffer, which `from_pretrained` materialises without initialising."""
        for module in self.modules():
            if isinstance(module, TopKRouter):
                module.expert_load.zero_()

    def update_router_biases(self, rate: float = 1e-3) -> None:
        """Aux-loss-free MoE balancing step for every MoE layer (call once per optimizer step)."""
        for module in self.modules():
            if isinstance(module, TopKRouter):
                module.update_router_bias(rate)


class KimiTextForCausalLM(KimiTextPreTrainedModel, HybridCacheGenerationMixin, GenerationMixin):
    """`KimiTextModel` + LM head. Loss: next-token cross-entropy, labels == -100 ignored."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: KimiTextConfig) -> None:
        super().__init__(config)
        self.model = KimiTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: KimiHybridCache | None = None,
        past_key_values: KimiHybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        loss_normalisation: str = "token",
        token_mask: torch.Tensor | None = None,
        return_logits: bool = True,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Next-token logits `[B, T, vocab]` (the last `logits_to_keep` positions when set; as in transformers, a 1-D
        tensor `logits_to_keep` lists the positions to keep) and, with `labels`, the
        loss (`causal_lm_loss`; `loss_normalisation="document"` weighs every packed sequence of `cu_seqlens`
        equally). `return_logits=False` (the trainer's forwards) with `labels`: when the logits would exceed
        `LOSS_CHUNK_ELEMENTS`, the loss comes from `chunked_causal_lm_loss` and `logits` is None.

        `num_items_in_batch`: the targets of the whole accumulated (and distributed) batch, which transformers'
        `Trainer` passes to models that take `**kwargs`: the loss is then the sum of this micro-batch's token losses
        divided by it, so that the accumulated gradient is that of the global token mean.

        `return_dict=False` (or `config.return_dict=False`) returns the output's `to_tuple()`, as transformers'
        models do."""
        refuse_attention_outputs(kwargs, self.config)
        cache = one_cache(cache, past_key_values)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, cu_seqlens=cu_seqlens,
            output_hidden_states=output_hidden_states, token_mask=token_mask, return_dict=True,
        )
        h = out.last_hidden_state
        per_document = loss_normalisation == "document"
        keep_all = isinstance(logits_to_keep, int) and not logits_to_keep
        if (labels is not None and not return_logits and keep_all
                and h.shape[0] * h.shape[1] * self.lm_head.out_features > LOSS_CHUNK_ELEMENTS):
            loss = chunked_causal_lm_loss(h, self.lm_head, labels, cu_seqlens, per_document=per_document,
                                          max_elements=LOSS_CHUNK_ELEMENTS, num_items_in_batch=num_items_in_batch)
            return CausalLMOutputWithPast(loss=loss, logits=None, cache=out.cache, hidden_states=out.hidden_states)
        if keep_all:
            logits = self.lm_head(h)
        else:
            logits = self.lm_head(h[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else h[:, logits_to_keep])
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, cu_seqlens, per_document=per_document,
                                  num_items_in_batch=num_items_in_batch)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, cache=out.cache, hidden_states=out.hidden_states
        )



def real_tokens(
    input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, pad_token_id: int | None, T: int
) -> torch.Tensor | None:
    """`[B, T]` bool: the last `T` tokens that `attention_mask` keeps and that are not `pad_token_id` (a packed row's
    tail and a response's positions after its end token are `pad_token_id` under a mask of ones); None when there is
    neither to go by. Never synchronises with the device (it runs in every training forward)."""
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, -T:].bool()
    if input_ids is not None and pad_token_id is not None:
        mask = input_ids != pad_token_id if mask is None else mask & (input_ids != pad_token_id)
    return mask


def next_token_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, T - 1]` targets of positions `0 .. T - 2` (`labels[:, 1:]`, -100 = no loss). With `cu_seqlens` (batch
    1), the last token of each packed sequence does not predict the first token of the next one (empty sequences
    at the start of the pack end before any token: they mask nothing)."""
    target = labels[:, 1:].clone()
    if cu_seqlens is not None:
        ends = cu_seqlens[1:-1].long() - 1
        target[0, ends[(ends >= 0) & (ends < target.shape[1])]] = -100
    return target


LOSS_CHUNK_ELEMENTS = 2**25
"""Logit elements (128 MiB in fp32) above which `chunked_causal_lm_loss` splits the tokens into chunks."""


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _token_losses(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`[N]` cross-entropy (fp32, or float64 for a float64 model) of logits `[N, vocab]` against target `[N]` (0
    where the target is -100)."""
    return F.cross_entropy(_at_least_fp32(logits), target, ignore_index=-100, reduction="none")


def _reduce_losses(losses: torch.Tensor, target: torch.Tensor, cu_seqlens: torch.Tensor | None,
                   per_document: bool, num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """The loss of per-token `losses` `[N]` against targets `[N]`: their mean over the targets != -100 (their sum
    divided by `num_items_in_batch` when given), or (with `per_document`) the mean over the packed sequences that
    have targets of each one's token mean."""
    valid = target != -100
    if not per_document:
        # nan without targets, as F.cross_entropy's mean
        return losses.sum() / (valid.sum() if num_items_in_batch is None else num_items_in_batch)
    segment, counts = _document_targets(target, cu_seqlens)
    weights = torch.where(valid, 1.0 / counts.clamp(min=1.0)[segment], torch.zeros_like(losses))
    return (losses * weights).sum() / (counts > 0).sum().clamp(min=1)


def _document_targets(target: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(segment [N], counts [docs])`: the packed sequence of each of the targets `[N]` and each sequence's number of
    targets != -100."""
    segment = torch.searchsorted(cu_seqlens[1:].to(target.device).long(),
                                 torch.arange(len(target), device=target.device), right=True)
    counts = torch.bincount(segment[target != -100], minlength=len(cu_seqlens) - 1).float()
    return segment, counts


def _check_loss_inputs(labels: torch.Tensor, shape: torch.Size, cu_seqlens: torch.Tensor | None,
                       per_document: bool, num_items_in_batch: int | torch.Tensor | None = None) -> None:
    if labels.shape != shape:
        raise ShapeError(f"labels have shape {tuple(labels.shape)}; expected {tuple(shape)}.")
    if per_document and (cu_seqlens is None or labels.shape[0] != 1):
        raise ShapeError("per-document loss normalisation needs packed inputs: batch 1 with cu_seqlens.")
    if per_document and num_items_in_batch is not None:
        raise ConfigError("num_items_in_batch divides the summed token losses: it cannot be combined with per-document "
                          "loss normalisation; pass one of them.")


def loss_denominator(labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *, per_document: bool = False
                     ) -> int:
    """What `causal_lm_loss` divides by for `labels [B, T]`: the number of `next_token_targets` != -100, or (with
    `per_document`) of packed sequences that have targets. Weighing each micro-batch's loss by it over the step's
    total makes an accumulated or distributed step's loss the mean over the whole global batch."""
    target = next_token_targets(labels, cu_seqlens).flatten()
    valid = target != -100
    if not per_document:
        return int(valid.sum())
    _check_loss_inputs(labels, labels.shape, cu_seqlens, per_document)
    return int((_document_targets(target, cu_seqlens)[1] > 0).sum())


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *, per_document: bool = False,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy over the `next_token_targets` != -100 (in fp32 or wider): the mean over those
    tokens (their sum divided by `num_items_in_batch`, the targets of the whole accumulated batch, when given), or
    with `per_document` (needs `cu_seqlens`) the mean over the packed sequences that have targets of each one's
    token mean (a document with a short answer weighs as much as a long one)."""
    _check_loss_inputs(labels, logits.shape[:2], cu_seqlens, per_document, num_items_in_batch)
    target = next_token_targets(labels, cu_seqlens).flatten()
    flat = logits[:, :-1].flatten(0, 1)
    if not per_document and num_items_in_batch is None:  # cross_entropy's own mean, as the quickstart's figures
        return F.cross_entropy(_at_least_fp32(flat), target, ignore_index=-100)
    return _reduce_losses(_token_losses(flat, target), target, cu_seqlens, per_document, num_items_in_batch)


def chunked_causal_lm_loss(
    hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
    per_document: bool = False, max_elements: int = LOSS_CHUNK_ELEMENTS,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_lm_loss(lm_head(hidden), labels, ...)` from the last hidden states `[B, T, hidden]` without holding
    the `[B, T, vocab]` logits: the tokens go through `lm_head` and the cross-entropy in chunks of at most
    `max_elements` logits, each chunk's logits recomputed in the backward instead of kept (activation
    checkpointing). Over 16384 tokens and a 32768-token vocabulary the loss's forward and backward peak at 0.09x the
    memory of the full logits' (6.0 GiB against 0.55 GiB in fp32), in about the same time (`bench/loss_memory.py`)."""
    _check_loss_inputs(labels, hidden.shape[:2], cu_seqlens, per_document, num_items_in_batch)
    target = next_token_targets(labels, cu_seqlens).flatten()
    flat = hidden[:, :-1].flatten(0, 1)
    chunk = max(1, max_elements // lm_head.out_features)

    def losses_of(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return _token_losses(lm_head(h), t)

    recompute = torch.is_grad_enabled() and flat.requires_grad
    losses = torch.cat([
        torch.utils.checkpoint.checkpoint(losses_of, flat[s : s + chunk], target[s : s + chunk], use_reentrant=False)
        if recompute else losses_of(flat[s : s + chunk], target[s : s + chunk])
        for s in range(0, len(target), chunk)
    ])
    return _reduce_losses(losses, target, cu_seqlens, per_document, num_items_in_batch)

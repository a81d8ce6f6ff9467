"""RL core (`kimi_vl.training.rl`): the K2.5 loss's acceptance properties (plain policy gradient at ratio 1, exact
zero gradient outside [alpha, beta] for both advantage signs, penalty gradient 2 tau log-ratio, group token-count
normalisation), GRPO, advantages, log-probs, rollouts with the cache (text, image and video prompts), the update
step with micro-batching, and RL learning a toy verifiable task on a tiny model."""

import copy
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from PIL import Image

from kimi_vl.errors import ConfigError, ShapeError
from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM
from kimi_vl.tokenization import DOC_EOS, IM_END, build_tokenizer, render_chat
from kimi_vl.training.rl import (
    RLConfig,
    RLStep,
    clip_mask,
    group_advantages,
    group_token_weights,
    grpo_loss,
    k25_loss,
    rl_iteration,
    rl_step,
    sequence_token_weights,
)
from kimi_vl.training.rollout import Rollouts, policy_logprobs, rollout, token_logprobs
from tests.test_export import tiny_model, tiny_processor


@dataclass
class Toy:
    """Stand-in for `kimi_vl.data.world.Sample` (RL reads only these attributes)."""

    question: str
    answer: str
    task: str = "arithmetic"
    reward: str = "number"
    image: object = None
    video: object = None
    choices: list | None = None
    meta: dict = field(default_factory=dict)


@dataclass
class Clip:
    """Stand-in for `kimi_vl.data.screencast.Screencast`."""

    frames: list
    fps: float = 4.0


# ------------------------------------------------------------------------------------------------ advantages, weights
def test_group_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    a = group_advantages(r)
    torch.testing.assert_close(a, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75], [0.0] * 4]))
    # GRPO: unbiased std of [1, 0, 0, 1] is sqrt(1/3)
    g = group_advantages(r, normalise_std=True)
    torch.testing.assert_close(g[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (3 ** -0.5 + 1e-6))
    assert torch.equal(g[2], torch.zeros(4))  # equal rewards: no signal, no division by zero
    assert torch.equal(group_advantages(torch.tensor([[3.0], [1.0]]), normalise_std=True), torch.zeros(2, 1))
    with pytest.raises(ShapeError, match="prompts, k"):
        group_advantages(torch.ones(4))


def test_groups_of_equal_rewards_get_exactly_zero_advantage():
    # 8 equal rewards of 0.7 (an OCR or count score): their float32 mean is one ulp off 0.7, which GRPO's division by
    # std + eps turned into an advantage of 0.056 for every response of the group
    r = torch.stack([torch.full((8,), v) for v in (0.7, 0.1, 1 / 3, 0.9)])
    assert torch.equal(group_advantages(r), torch.zeros(4, 8))
    assert torch.equal(group_advantages(r, normalise_std=True), torch.zeros(4, 8))


def test_group_token_weights_hand_computed():
    # two groups of two: group 0 has 3 + 1 = 4 tokens, group 1 has 2 + 2 = 4... make them differ: 2 + 0 = 2
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.float)
    w = group_token_weights(mask, group_size=2)
    expected = torch.tensor([[1 / 8] * 3, [1 / 8, 0, 0], [1 / 4, 1 / 4, 0], [0, 0, 0]])  # 1 / (P=2 * N_g)
    torch.testing.assert_close(w, expected)
    assert float(w.sum()) == pytest.approx(1.0)
    torch.testing.assert_close(group_token_weights(mask), mask / 6)
    torch.testing.assert_close(sequence_token_weights(mask)[1], torch.tensor([0.25, 0, 0]))  # 1 / (N=4 * 1)
    with pytest.raises(ShapeError, match="groups of 3"):
        group_token_weights(mask, group_size=3)


# ---------------------------------------------------------------------------------------------------- the K2.5 loss
def _inputs(n=4, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(n, t, generator=g) * 3).requires_grad_(True)
    mask = torch.ones(n, t)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    adv = torch.randn(n, generator=g)
    return logp, mask, adv


def test_k25_equals_plain_policy_gradient_at_ratio_one():
    logp, mask, adv = _inputs()
    loss = k25_loss(logp, logp.detach(), adv, mask, alpha=-0.2, beta=0.2, tau=0.0, group_size=2)
    (grad,) = torch.autograd.grad(loss, logp)
    w = group_token_weights(mask, 2)
    pg = -(w * adv[:, None] * logp).sum()
    (pg_grad,) = torch.autograd.grad(pg, logp)
    torch.testing.assert_close(grad, pg_grad, rtol=0, atol=1e-7)
    assert loss.item() == pytest.approx(float(-(w * adv[:, None]).sum()), abs=1e-7)
    # hand-computed: one group of 2 rows, 2 + 1 tokens, advantages +1 / -1 -> loss = -(2 * 1 + 1 * -1) / 3
    lp = torch.zeros(2, 2, requires_grad=True)
    loss = k25_loss(lp, lp.detach(), torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), -1, 1, 0.0,
                    group_size=2)
    assert loss.item() == pytest.approx(-1 / 3)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, torch.tensor([[-1 / 3, -1 / 3], [1 / 3, 0.0]]))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_k25_tokens_outside_interval_get_exactly_zero_gradient(sign):
    alpha, beta = -0.3, 0.2
    logp = torch.zeros(2, 4, requires_grad=True)
    old = torch.tensor([[0.0, 0.5, -0.25, 0.31], [-0.15, 0.0, 0.29, -0.1]])  # log-ratio = -old
    log_ratio = -old
    outside = (log_ratio < alpha) | (log_ratio > beta)
    assert outside.sum() == 3  # -0.5 and -0.31 below alpha, 0.25 above beta
    adv = sign * torch.tensor([1.0, 2.0])
    mask = torch.ones(2, 4)
    for tau, penalty_on_masked in ((0.0, True), (0.7, False)):
        loss = k25_loss(logp, old, adv, mask, alpha, beta, tau, group_size=2, penalty_on_masked=penalty_on_masked)
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.equal(grad[outside], torch.zeros(int(outside.sum())))  # exactly zero, either sign
        assert (grad[~outside] != 0).all()
    # with the penalty on every token (Eq. 1 as written) masked tokens get exactly the penalty gradient
    tau = 0.7
    loss = k25_loss(logp, old, adv, mask, alpha, beta, tau, group_size=2)
    (grad,) = torch.autograd.grad(loss, logp)
    w = group_token_weights(mask, 2)
    torch.testing.assert_close(grad[outside], (w * 2 * tau * log_ratio)[outside], rtol=0, atol=1e-7)
    assert torch.equal(clip_mask(log_ratio, alpha, beta), ~outside)


def test_k25_masked_token_with_overflowing_ratio_has_no_nan():
    logp = torch.zeros(1, 3, requires_grad=True)
    old = torch.tensor([[-200.0, 0.0, 200.0]])  # ratios e^200 and e^-200
    loss = k25_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3), -0.5, 0.5, 0.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[0, 0] == 0 and grad[0, 2] == 0 and grad[0, 1] != 0


def test_k25_penalty_gradient_is_two_tau_log_ratio():
    logp, mask, _ = _inputs()
    old = logp.detach() + 0.05 * torch.randn_like(logp)  # |log-ratio| well inside [-1, 1]
    tau = 0.3
    loss = k25_loss(logp, old, torch.zeros(4), mask, -1.0, 1.0, tau, group_size=2)
    (grad,) = torch.autograd.grad(loss, logp)
    w = group_token_weights(mask, 2)
    torch.testing.assert_close(grad, w * 2 * tau * (logp.detach() - old), rtol=1e-5, atol=1e-8)
    assert loss.item() == pytest.approx(float((w * tau * (logp.detach() - old) ** 2).sum()), rel=1e-5)
    # general ratio: d/dlogp = w * (-rho * A + 2 tau lr)
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    loss = k25_loss(logp, old, adv, mask, -1.0, 1.0, tau, group_size=2)
    (grad,) = torch.autograd.grad(loss, logp)
    lr = logp.detach() - old
    torch.testing.assert_close(grad, w * (-lr.exp() * adv[:, None] + 2 * tau * lr), rtol=1e-5, atol=1e-8)


def test_k25_normalises_by_group_token_count():
    # group 0: rows with 3 and 1 tokens (N_0 = 4); group 1: rows with 2 and 0 tokens (N_1 = 2); ratio 1, tau 0
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.float)
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0])
    lp = torch.zeros(4, 3, requires_grad=True)
    loss = k25_loss(lp, lp.detach(), adv, mask, -1, 1, 0.0, group_size=2)
    group0 = -(3 * 1.0 + 1 * -1.0) / 4
    group1 = -(2 * 2.0) / 2
    assert loss.item() == pytest.approx((group0 + group1) / 2)
    # longer responses do not weigh more per token across groups of different lengths: every token of group g
    # contributes 1 / (P * N_g)
    (grad,) = torch.autograd.grad(loss, lp)
    assert float(grad[0, 0]) == pytest.approx(-1 / 8) and float(grad[2, 0]) == pytest.approx(-2 / 4)
    # explicit weights (a micro-batch slice of the full batch's weights) give the same total
    w = group_token_weights(mask, 2)
    halves = sum(k25_loss(lp[s], lp[s].detach(), adv[s], mask[s], -1, 1, 0.0, weights=w[s]).item()
                 for s in (slice(0, 1), slice(1, 4)))
    assert halves == pytest.approx(loss.item())


def test_k25_shape_errors():
    lp = torch.zeros(2, 3)
    with pytest.raises(ShapeError, match="old_logp"):
        k25_loss(lp, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3), -1, 1, 0)
    with pytest.raises(ShapeError, match="advantages"):
        k25_loss(lp, lp, torch.zeros(3), torch.ones(2, 3), -1, 1, 0)


# ------------------------------------------------------------------------------------------------------------- GRPO
def test_grpo_loss_hand_computed():
    # one token per sequence; ratios 1.5 (A=+1, clipped to 1.2), 0.5 (A=+1, unclipped 0.5), 0.5 (A=-1, clipped -0.8)
    old = torch.zeros(3, 1)
    logp = torch.log(torch.tensor([[1.5], [0.5], [0.5]])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss = grpo_loss(logp, old, adv, torch.ones(3, 1), clip_eps=0.2)
    assert loss.item() == pytest.approx(-(1.2 + 0.5 - 0.8) / 3, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    # clipped branches have zero gradient; the unclipped one: -rho * A / N = -0.5 / 3
    torch.testing.assert_close(grad, torch.tensor([[0.0], [-0.5 / 3], [0.0]]))
    # k3 KL: ref - logp = d -> exp(d) - d - 1
    ref = torch.tensor([[0.0], [0.0], [0.0]])
    kl = grpo_loss(logp, logp.detach(), torch.zeros(3), torch.ones(3, 1), 0.2, ref_logp=ref, kl_coef=0.1)
    d = ref - logp.detach()
    assert kl.item() == pytest.approx(float(0.1 * (d.exp() - d - 1).mean()), rel=1e-6)
    with pytest.raises(ConfigError, match="ref_model"):
        grpo_loss(logp, old, adv, torch.ones(3, 1), 0.2, kl_coef=0.1)


def test_grpo_sequence_mean_normalisation():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    lp = torch.zeros(2, 4, requires_grad=True)
    loss = grpo_loss(lp, lp.detach(), torch.tensor([1.0, 1.0]), mask, 0.2)
    (grad,) = torch.autograd.grad(loss, lp)
    assert loss.item() == pytest.approx(-1.0)  # mean over sequences of each sequence's token mean
    torch.testing.assert_close(grad, torch.tensor([[-1 / 8] * 4, [-1 / 2, 0, 0, 0]]))


def test_rl_config_validation():
    with pytest.raises(ConfigError, match="algorithm"):
        RLConfig(algorithm="ppo")
    with pytest.raises(ConfigError, match="alpha"):
        RLConfig(alpha=0.5, beta=0.1)
    # K2.5's Eq. 1 writes Clip(ratio, alpha, beta): alpha=0.8, beta=1.2 taken as log-ratio bounds masked every token
    # of the first update (ratio 1), so the run trained on nothing but the penalty
    with pytest.raises(ConfigError, match=r"must include 0 .* ratios pi_theta / pi_old in \[0.8, 1.2\] pass "
                                          r"alpha=-0.2231, beta=0.1823"):
        RLConfig(alpha=0.8, beta=1.2)
    with pytest.raises(ConfigError, match="must include 0"):
        RLConfig(alpha=-0.5, beta=-0.1)
    RLConfig(alpha=0.0, beta=0.1), RLConfig(alpha=-0.1, beta=0.0)  # bounds are inclusive: 0 itself is kept
    # TRL's habit (beta=0.04) without --algorithm grpo: K2.5 has no KL term, so the coefficient was silently ignored
    with pytest.raises(ConfigError, match=r"kl_coef=0.04 is GRPO's KL .* pass algorithm='grpo'"):
        RLConfig(kl_coef=0.04)
    RLConfig(algorithm="grpo", kl_coef=0.04)
    with pytest.raises(ConfigError, match="greedy"):
        RLConfig(temperature=0)
    for k in (0, 1):  # a group of one has zero advantage: k=1 trained nothing, silently
        with pytest.raises(ConfigError, match=f"k={k}: sample at least 2 responses"):
            RLConfig(k=k)
    for name, value in (("tau", float("nan")), ("kl_coef", float("nan")), ("clip_eps", float("nan")),
                        ("temperature", float("inf")), ("beta", float("inf"))):
        with pytest.raises(ConfigError, match=f"{name}={value} must be a finite number"):
            RLConfig(**{name: value})


# ------------------------------------------------------------------------------------------------------ tiny models
ARITH_TEXTS = [render_chat([{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}])
               for a in range(10) for b in range(10)]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(ARITH_TEXTS, 300)


def text_model(tok, seed=0, hidden=32) -> KimiTextForCausalLM:
    torch.manual_seed(seed)
    config = KimiTextConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=16,
        num_hidden_layers=2, layer_types=["kda", "mla"], first_k_dense=2, num_attention_heads=2, kv_lora_rank=12,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_experts=4, num_experts_per_tok=2, kda_head_dim=8,
        kda_num_heads=2, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    return KimiTextForCausalLM(config)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [Toy(f"{a}+{b}=", str(a + b)) for a, b in ((rng.randrange(10), rng.randrange(10)) for _ in range(n))]


# -------------------------------------------------------------------------------------------------------- log-probs
@torch.no_grad()
def test_token_logprobs_match_full_log_softmax_and_entropy(tok):
    model = text_model(tok).eval()
    ids = torch.randint(13, len(tok), (3, 9))
    attn = torch.ones_like(ids)
    attn[0, :2] = 0  # left padding
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logp, ent = token_logprobs(model, ids, attn, mask, temperature=0.7, with_entropy=True)
    full = (model(input_ids=ids, attention_mask=attn, use_cache=False).logits / 0.7).log_softmax(-1)
    expected = full[:, -4:-1].gather(-1, ids[:, -3:, None]).squeeze(-1) * mask
    torch.testing.assert_close(logp, expected, rtol=1e-5, atol=1e-5)
    expected_ent = -(full[:, -4:-1].exp() * full[:, -4:-1]).sum(-1) * mask
    torch.testing.assert_close(ent, expected_ent, rtol=1e-5, atol=1e-5)
    with pytest.raises(ShapeError, match="at least one token"):
        token_logprobs(model, ids[:, :3], attn[:, :3], torch.ones(3, 3))


# --------------------------------------------------------------------------------------------------------- rollouts
def test_rollout_text_shapes_masks_and_old_logprobs(tok):
    model = text_model(tok)
    samples = _prompts(3) + [Toy("12+34=", "46")]  # prompts of different lengths -> left padding
    ro = rollout(model, tok, samples, k=4, max_new_tokens=5, temperature=1.3, seed=1, micro_batch_size=5)
    assert model.training  # mode restored
    N = 16
    assert ro.num_prompts == 4 and ro.num_sequences == N and ro.response_ids.shape[0] == N
    assert ro.response_ids.shape == ro.response_mask.shape == ro.old_logp.shape
    assert ro.response_ids.shape[1] <= 5 and len(ro.texts) == N
    ends = {tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(DOC_EOS)}
    for n in range(N):
        length = int(ro.lengths[n])
        row = ro.response_ids[n].tolist()
        assert ro.response_mask[n, :length].all() and not ro.response_mask[n, length:].any()
        if ro.truncated[n]:
            assert length == ro.response_ids.shape[1] and not ends & set(row)
        else:  # the mask stops right after the first end token (<|im_end|> or [EOS])
            assert row[length - 1] in ends and not ends & set(row[: length - 1])
            assert all(t == tok.pad_token_id for t in row[length:])
        assert ro.texts[n] == tok.decode(row[: length - (0 if ro.truncated[n] else 1)], skip_special_tokens=True)
    assert (ro.old_logp[ro.response_mask == 0] == 0).all() and (ro.old_logp[ro.response_mask == 1] < 0).all()
    # old log-probs are the rollout-time policy's, computed on the same micro-batches the update uses
    torch.testing.assert_close(policy_logprobs(model, ro), ro.old_logp, rtol=0, atol=0)
    # seeded sampling is reproducible and leaves the global RNG alone
    state = torch.get_rng_state()
    again = rollout(model, tok, samples, k=4, max_new_tokens=5, temperature=1.3, seed=1, micro_batch_size=5)
    assert torch.equal(again.response_ids, ro.response_ids) and torch.equal(torch.get_rng_state(), state)
    # a row's response depends on its seed, its prompt's global index and the model only: not on the generation
    # batches, nor on which other prompts (another rank's share) are generated with it
    split = rollout(model, tok, samples, k=4, max_new_tokens=5, temperature=1.3, seed=1, generation_batch_size=8)
    assert torch.equal(split.response_ids, ro.response_ids)
    share = rollout(model, tok, samples[2:], k=4, max_new_tokens=5, temperature=1.3, seed=1, prompt_indices=[2, 3])
    assert share.texts == ro.texts[8:]
    other = rollout(model, tok, samples, k=4, max_new_tokens=5, temperature=1.3, seed=2)
    assert not torch.equal(other.response_ids, ro.response_ids)


@torch.no_grad()
def test_old_logprobs_are_the_sampling_distribution(tok):
    """The recorded log-probs equal those of the distribution generate() sampled from (softmax(logits / T))."""
    model = text_model(tok).eval()
    samples = _prompts(2) + [Toy("12+34=", "46")]
    ro = rollout(model, tok, samples, k=2, max_new_tokens=4, temperature=0.8, seed=3)
    inputs = ro.model_inputs(range(ro.num_sequences))
    width = inputs["input_ids"].shape[1] - inputs["response_mask"].shape[1]
    prompt = {"input_ids": inputs["input_ids"][:, :width], "attention_mask": inputs["attention_mask"][:, :width]}
    # teacher-force the sampled responses through the cached decode path and compare step by step
    cache_logits = []
    past = None
    ids = prompt["input_ids"]
    attn = prompt["attention_mask"]
    step_in = ids
    for t in range(ro.response_ids.shape[1]):
        res = model(input_ids=step_in, attention_mask=attn, cache=past, use_cache=True)
        past = res.cache
        cache_logits.append(res.logits[:, -1])
        step_in = ro.response_ids[:, t : t + 1]
        attn = torch.cat([attn, torch.ones_like(step_in)], dim=1)
    assert ro.suppress_token_ids  # the media placeholders can never be sampled
    logits = torch.stack(cache_logits, 1).index_fill(-1, torch.tensor(ro.suppress_token_ids), -torch.inf)
    cached = (logits / 0.8).log_softmax(-1).gather(-1, ro.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(cached * ro.response_mask, ro.old_logp, rtol=1e-4, atol=1e-4)


def _image(seed, w, h):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def test_rollout_and_step_with_images_and_video():
    proc = tiny_processor()
    model = tiny_model(proc)
    frames = [_image(10 + i, 56, 42) for i in range(4)]
    samples = [
        Toy("how many circles", "3", task="count", reward="count", image=_image(1, 60, 40)),
        Toy("what is 1+1", "2"),
        Toy("describe the video", "<p>x</p>", task="screencast", reward="html", video=Clip(frames)),
        Toy("what image", "4", task="count", reward="count", image=_image(2, 28, 56)),
    ]
    ro = rollout(model, proc, samples, k=2, max_new_tokens=4, seed=0, micro_batch_size=3)
    assert ro.media[0]["image_grid_thw"].shape == (1, 3) and not ro.media[1]
    assert "video_grid_thw" in ro.media[2] and "pixel_values" not in ro.media[2]
    # a micro-batch spanning rows of several prompts carries exactly those rows' media, in row order
    inputs = ro.model_inputs(range(1, 6))
    assert inputs["image_grid_thw"].shape[0] == 1 and inputs["video_grid_thw"].shape[0] >= 1
    assert int((inputs["input_ids"] == proc.image_token_id).sum()) == int(ro.media[0]["image_grid_thw"].prod()) // 4
    # the image changes the old log-probs (the media reach the model)
    swapped = copy.copy(ro)
    swapped.media = [dict(m) for m in ro.media]
    swapped.media[0]["pixel_values"] = torch.randn_like(ro.media[0]["pixel_values"])
    assert not torch.allclose(policy_logprobs(model, swapped)[:2], ro.old_logp[:2])
    rewards = ro.rewards()
    assert rewards.shape == (4, 2) and ((rewards >= 0) & (rewards <= 1)).all()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vision_before = model.vision_tower.patch_embed.proj.weight.detach().clone()
    metrics = rl_step(model, opt, ro, torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.5, 0.5]]),
                      RLConfig(k=2, micro_batch_size=3))
    assert metrics["log_ratio_abs_mean"] == 0.0 and metrics["masked_fraction"] == 0.0  # ratio exactly 1
    assert set(metrics) >= {"reward/count", "reward/arithmetic", "reward/screencast", "entropy", "loss"}
    assert metrics["reward/count"] == pytest.approx(0.5) and metrics["reward/screencast"] == pytest.approx(0.5)
    assert not torch.equal(model.vision_tower.patch_embed.proj.weight, vision_before)  # vision is trained too


def test_rollout_refuses_media_for_a_text_model():
    proc = tiny_processor()
    model = text_model(proc.tokenizer)
    with pytest.raises(ConfigError, match="takes no media"):
        rollout(model, proc, [Toy("q", "1", image=_image(0, 28, 28))], k=2, max_new_tokens=2)
    with pytest.raises(ConfigError, match="KimiVLProcessor"):
        rollout(model, proc.tokenizer, [Toy("q", "1", image=_image(0, 28, 28))], k=2, max_new_tokens=2)


def test_rollout_with_world_samples():
    world = pytest.importorskip("kimi_vl.data.world")
    proc = tiny_processor()
    model = tiny_model(proc)
    rng = random.Random(0)
    samples = [world.make_sample(task, rng) for task in ("count", "arithmetic", "screencast")]
    ro = rollout(model, proc, samples, k=2, max_new_tokens=3, seed=0, micro_batch_size=4)
    assert ro.num_sequences == 6 and "video_grid_thw" in ro.media[2] and "pixel_values" in ro.media[0]
    assert ro.rewards().shape == (3, 2)


# ----------------------------------------------------------------------------------------------------------- update
def _flat_grad_step(model, ro, rewards, cfg):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    rl_step(model, opt, ro, rewards, cfg, max_grad_norm=None)
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])


def test_micro_batches_accumulate_to_the_full_batch_gradient(tok):
    model = text_model(tok)
    ro = rollout(model, tok, _prompts(3), k=4, max_new_tokens=4, seed=0, micro_batch_size=12)
    rewards = torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    cfg = RLConfig(k=4, micro_batch_size=12)
    full = _flat_grad_step(copy.deepcopy(model), ro, rewards, cfg)
    ro_small = copy.copy(ro)
    ro_small.micro_batch_size = 5
    ro_small.old_logp = policy_logprobs(model, ro_small, 5)
    small = _flat_grad_step(copy.deepcopy(model), ro_small, rewards, RLConfig(k=4, micro_batch_size=5))
    assert full.abs().max() > 0
    torch.testing.assert_close(small, full, rtol=1e-4, atol=1e-6)


def test_first_update_has_ratio_one_and_later_updates_do_not(tok):
    model = text_model(tok)
    ro = rollout(model, tok, _prompts(4), k=4, max_new_tokens=3, seed=0, micro_batch_size=8)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    twin = copy.deepcopy(model)
    one = rl_step(twin, torch.optim.AdamW(twin.parameters(), lr=0.05), ro, rewards, RLConfig(k=4, micro_batch_size=8))
    assert one["log_ratio_abs_mean"] == 0.0 and one["masked_fraction"] == 0.0
    cfg = RLConfig(k=4, micro_batch_size=8, updates_per_batch=3, alpha=-0.05, beta=0.05)
    several = rl_step(model, opt, ro, rewards, cfg)
    assert several["log_ratio_abs_mean"] > 0 and 0 < several["masked_fraction"] < 1
    assert several["updates"] == 3.0
    for key in ("loss", "reward_mean", "reward_std", "response_length", "truncated_fraction", "entropy",
                "zero_advantage_groups", "advantage_abs_mean", "grad_norm", "reward/arithmetic"):
        assert key in several
    assert several["reward_mean"] == pytest.approx(0.25)
    with pytest.raises(ShapeError, match="one reward per response"):
        rl_step(model, opt, ro, torch.ones(5), cfg)


def test_grpo_step_with_reference_model(tok):
    model = text_model(tok)
    ref = copy.deepcopy(model)
    cfg = RLConfig(algorithm="grpo", k=4, max_new_tokens=3, kl_coef=0.1, micro_batch_size=8)
    ro = rollout(model, tok, _prompts(2), k=4, max_new_tokens=3, seed=0, ref_model=ref)
    torch.testing.assert_close(ro.ref_logp, ro.old_logp)
    metrics = rl_step(model, torch.optim.SGD(model.parameters(), lr=0.1), ro, torch.rand(2, 4), cfg)
    assert metrics["masked_fraction"] == 0.0 and np.isfinite(metrics["loss"])
    no_ref = rollout(model, tok, _prompts(2), k=4, max_new_tokens=3, seed=0)
    with pytest.raises(ConfigError, match="ref_model"):
        rl_step(model, torch.optim.SGD(model.parameters(), lr=0.1), no_ref, torch.rand(2, 4), cfg)


def test_rewards_use_the_token_budget():
    samples = _prompts(2)
    mask = torch.zeros(8, 6)
    mask[:4, :2] = 1  # the first prompt's responses are 2 tokens long, the second's 6
    mask[4:, :] = 1
    ro = Rollouts(samples=samples, group_size=4, prompts=[torch.tensor([1, 2])] * 2, media=[{}, {}],
                  response_ids=torch.zeros(8, 6, dtype=torch.long), response_mask=mask, old_logp=torch.zeros(8, 6),
                  texts=[samples[n // 4].answer for n in range(8)], truncated=torch.zeros(8, dtype=torch.bool),
                  pad_token_id=2)  # every answer right
    assert torch.equal(ro.rewards(), torch.ones(2, 4))
    assert torch.equal(ro.rewards(token_budget=3), torch.tensor([[1.0] * 4, [0.0] * 4]))
    custom = ro.rewards(lambda sample, text, num_tokens: float(num_tokens))
    assert torch.equal(custom, torch.tensor([[2.0] * 4, [6.0] * 4]))
    # `RLConfig.token_budget` (what `rl_iteration` passes here) holds for a reward function of your own too
    budgeted = ro.rewards(lambda sample, text, num_tokens: 1.0, token_budget=3)
    assert torch.equal(budgeted, torch.tensor([[1.0] * 4, [0.0] * 4]))


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), "1", [1.0], torch.ones(2)])
def test_a_reward_function_returning_no_finite_number_is_refused(bad):
    samples = _prompts(2)
    ro = Rollouts(samples=samples, group_size=4, prompts=[torch.tensor([1, 2])] * 2, media=[{}, {}],
                  response_ids=torch.zeros(8, 6, dtype=torch.long), response_mask=torch.ones(8, 6),
                  old_logp=torch.zeros(8, 6), texts=[str(n) for n in range(8)],
                  truncated=torch.zeros(8, dtype=torch.bool), pad_token_id=2)
    # NaN or inf went into the advantages (a NaN loss; NaN weights in a loop of your own), None, a list or a tensor
    # of several values stopped with a bare TypeError, a string was read as its number
    with pytest.raises(ConfigError, match="response 1 of prompt 1; return one finite number"):
        ro.rewards(lambda sample, text, num_tokens: bad if text == "5" else 1.0)
    for good in (torch.tensor(0.5), np.float64(0.5), True, 1):
        assert torch.equal(ro.rewards(lambda sample, text, num_tokens, good=good: good), torch.full((2, 4), float(good)))


# ------------------------------------------------------------------------------------------------------- RL learns
def _sft_warmup(model, tok, pairs, steps, lr, seed, target=lambda a, b, rng: a + b):
    """A few steps of SFT on `a+b=` prompts with replies `target(a, b, rng)` + `<|im_end|>` (a weak SFT
    checkpoint)."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        rows = []
        for a, b in (rng.choice(pairs) for _ in range(32)):
            prompt = render_chat([{"role": "user", "content": f"{a}+{b}="}], add_generation_prompt=True)
            rows.append((tok(prompt)["input_ids"], tok(f"{target(a, b, rng)}{IM_END}")["input_ids"]))
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id)
        labels = torch.full_like(ids, -100)
        attn = torch.zeros_like(ids)
        for r, (p, a) in enumerate(rows):
            ids[r, width - len(p) - len(a):] = torch.tensor(p + a)
            attn[r, width - len(p) - len(a):] = 1
            labels[r, width - len(a):] = torch.tensor(a)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def _curve(model, tok, cfg, opt, make_samples, steps):
    curve = []
    for step in range(steps):
        metrics, _ = rl_iteration(model, opt, tok, make_samples(step), cfg, seed=step)
        curve.append(metrics["reward_mean"])
    print("reward curve", [round(c, 3) for c in curve])
    return curve


@pytest.mark.parametrize("algorithm", ["k25", "grpo"])
def test_rl_learns_a_fixed_answer_fast(tok, algorithm):
    """Easy task: every question's answer is 7, from a model SFT-ed to answer a random digit (reward ~0.1).
    K2.5 and GRPO both find it."""
    torch.set_num_threads(1)
    model = text_model(tok)
    pairs = [(a, b) for a in range(5) for b in range(5)]
    _sft_warmup(model, tok, pairs, steps=20, lr=3e-3, seed=0, target=lambda a, b, rng: rng.randrange(10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    cfg = RLConfig(algorithm=algorithm, k=8, max_new_tokens=2, micro_batch_size=64)
    rng = random.Random(0)
    curve = _curve(model, tok, cfg, opt, lambda s: [Toy(f"{rng.randrange(5)}+{rng.randrange(5)}=", "7")
                                                    for _ in range(8)], 15)
    first, last = np.mean(curve[:3]), np.mean(curve[-3:])
    assert last - first > 0.3, curve


def test_rl_learns_arithmetic(tok):
    """a + b with a, b in {0, 1, 2} (answers 0..4, drawn uniformly so no single answer scores above 0.2 on
    average) from a weak SFT checkpoint; K2.5 loss, K = 8, 16 prompts per step, 4 updates per batch (the ratio,
    mask and penalty are active), AdamW. The mean reward of the last 5 of 30 steps beats the first 5 by > 0.3
    (measured on CPU: 0.27 -> 0.78 with this seed; seeds 0-4 at 25 steps gave margins 0.36-0.66)."""
    torch.set_num_threads(1)
    model = text_model(tok)
    pairs = [(a, b) for a in range(3) for b in range(3)]
    _sft_warmup(model, tok, pairs, steps=40, lr=3e-3, seed=0)
    by_answer: dict[int, list] = {}
    for a, b in pairs:
        by_answer.setdefault(a + b, []).append((a, b))
    rng = random.Random(0)

    def make_samples(step):
        chosen = [rng.choice(by_answer[rng.choice(sorted(by_answer))]) for _ in range(16)]
        return [Toy(f"{a}+{b}=", str(a + b)) for a, b in chosen]

    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    cfg = RLConfig(k=8, max_new_tokens=2, micro_batch_size=128, updates_per_batch=4)
    curve = _curve(model, tok, cfg, opt, make_samples, 30)
    first, last = np.mean(curve[:5]), np.mean(curve[-5:])
    assert last - first > 0.3 and last > 0.5, curve


@torch.no_grad()
def test_rollouts_never_sample_media_placeholders(tok):
    """A generated placeholder would be taken for a media slot when the sequence is re-encoded: it is suppressed."""
    model = text_model(tok).eval()
    placeholder = tok.convert_tokens_to_ids("<|media_pad|>")
    model.lm_head.weight[placeholder] = 50 * model.lm_head.weight.abs().max()  # the model would always pick it
    ro = rollout(model, tok, _prompts(2), k=2, max_new_tokens=4, seed=0)
    assert placeholder in ro.suppress_token_ids
    assert not (ro.response_ids == placeholder).any()
    assert torch.isfinite(ro.old_logp).all()


def test_prompts_that_do_not_split_over_the_processes_name_the_options_to_change():
    """1 prompt per rollout batch over 2 processes: the error names the settings that set the count, for users'
    data and for the embedded data's families (whose count is not `prompts_per_step`)."""
    from types import SimpleNamespace

    step = RLStep(lambda index: (["one prompt"], []), None, RLConfig(), seed=0)
    trainer = SimpleNamespace(accelerator=SimpleNamespace(num_processes=2, process_index=0))
    with pytest.raises(ConfigError, match=r"1 prompts per step do not split over 2 processes; .* --prompts-per-step; "
                                          r"the embedded data: --prompts-per-family times the number of --families"):
        step._roll(trainer, 0)

"""Training-step throughput of `KimiTextForCausalLM` against transformers' `KimiLinearForCausalLM`.

Same tiny config (hidden 256, 8 layers in the 3:1 hybrid, 8 experts top-2), same weights (ours is converted
from theirs), batch 4 x 512, fp32 on CPU, forward + backward + AdamW step. Prints tokens/s of each and the
ratio ours/theirs (target >= 2x).

    python bench/text_train.py [--threads 2] [--steps 3] [--batch 4] [--seq 512]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from common import median_time
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from kimi_vl.convert import convert_kimi_linear
from kimi_vl.text import KimiTextForCausalLM


def hf_config() -> KimiLinearConfig:
    return KimiLinearConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=704, moe_intermediate_size=256, num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64,
        v_head_dim=64, linear_head_dim=64, linear_num_heads=4, num_local_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def step_fn(model: torch.nn.Module, ids: torch.Tensor) -> callable:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    theirs = KimiLinearForCausalLM(hf_config())
    with tempfile.TemporaryDirectory() as tmp:
        theirs.save_pretrained(f"{tmp}/hf")
        convert_kimi_linear(f"{tmp}/hf", f"{tmp}/ours")
        ours = KimiTextForCausalLM.from_pretrained(f"{tmp}/ours")
    ours.train()
    theirs.train()
    # transformers' MoE asserts nothing about training here, but its experts loop is the reference path.
    ids = torch.randint(3, 4096, (args.batch, args.seq))
    with torch.no_grad():
        diff = (ours(ids, use_cache=False).logits - theirs(ids, use_cache=False).logits).abs().max().item()
    tokens = args.batch * args.seq
    # Interleaved (ours, theirs, ours, ...) so that load from other processes hits both alike.
    step_ours, step_theirs = step_fn(ours, ids), step_fn(theirs, ids)
    step_ours(), step_theirs()  # warm-up
    runs_ours, runs_theirs = [], []
    for _ in range(args.steps):
        runs_ours.append(median_time(step_ours, 1, warmup=0))
        runs_theirs.append(median_time(step_theirs, 1, warmup=0))
    t_ours, t_theirs = statistics.median(runs_ours), statistics.median(runs_theirs)
    print(f"batch {args.batch} x {args.seq}, {args.threads} threads, fp32, max |logit diff| before training {diff:.2e}")
    print(f"transformers KimiLinearForCausalLM: {tokens / t_theirs:9.1f} tokens/s ({t_theirs:.2f} s/step)")
    print(f"kimi_vl KimiTextForCausalLM:        {tokens / t_ours:9.1f} tokens/s ({t_ours:.2f} s/step)")
    print(f"RATIO train tokens/s ours/transformers = {t_theirs / t_ours:.2f}x (target >= 2x)")


if __name__ == "__main__":
    main()

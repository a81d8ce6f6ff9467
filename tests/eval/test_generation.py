"""The evaluation engine's batching: a batch returns what each of its requests gets alone."""

import torch
from tokenizers import processors

from kimi_vl.eval.generation import Engine, GenerationRequest
from tests.test_export import tiny_model, tiny_processor


@torch.no_grad()
def test_a_batch_mixing_raw_and_chat_prompts_gives_each_its_own_reply():
    """Raw prompts keep the tokenizer's special tokens (here a BOS) in a batch that also holds chat prompts, whose
    rendered template already has its own: each reply is the one its request gets alone."""
    proc = tiny_processor()
    tok = proc.tokenizer
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", pair="[BOS] $A $B", special_tokens=[("[BOS]", tok.bos_token_id)]
    )
    engine = Engine(model=tiny_model(proc), tokenizer=tok)
    requests = [GenerationRequest("the cat sees a red"), GenerationRequest("what is the", chat=True),
                GenerationRequest("a dog")]
    alone = [engine.generate([r], max_new_tokens=6)[0] for r in requests]
    assert engine.generate(requests, max_new_tokens=6) == alone

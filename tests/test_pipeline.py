"""`transformers.pipeline("image-text-to-text")` on a saved tiny Kimi-VL model (model + processor + tokenizer)."""

import json

import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor, pipeline

import kimi_vl  # noqa: F401  (registers the Auto classes)
from kimi_vl.tokenization import IM_END
from tests.test_export import tiny_model, tiny_processor


def test_image_text_to_text_pipeline(tmp_path):
    proc = tiny_processor()
    model = tiny_model(proc)
    model.save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    # generation stops at the end of the assistant turn
    eos = proc.tokenizer.convert_tokens_to_ids(IM_END)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == eos

    pipe = pipeline("image-text-to-text", model=str(tmp_path))
    assert type(pipe.model).__name__ == "KimiVLForConditionalGeneration"
    assert type(pipe.processor).__name__ == "KimiVLProcessor"
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "the cat"}]}]
    out = pipe(text=messages, max_new_tokens=6, generate_kwargs={"do_sample": False})
    answer = out[0]["generated_text"][-1]
    assert answer["role"] == "assistant" and isinstance(answer["content"], str)

    # the same answer as the processor + generate by hand
    inputs = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    expected = proc.post_process_image_text_to_text(generated[:, inputs["input_ids"].shape[1]:])[0]
    assert answer["content"] == expected

    # plain text with a placeholder (no chat) returns the prompt followed by the continuation
    prompt = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>the cat"
    out = pipe(images=image, text=prompt, max_new_tokens=3, generate_kwargs={"do_sample": False})
    assert isinstance(out[0]["generated_text"], str) and out[0]["generated_text"].startswith(prompt)


def test_a_padded_batch_generates_what_each_prompt_does_alone(tmp_path):
    proc = tiny_processor()
    model = tiny_model(proc).eval()
    assert proc.tokenizer.padding_side == "left"  # the tokenizer's default, saved with it
    proc.save_pretrained(tmp_path)
    assert AutoProcessor.from_pretrained(tmp_path).tokenizer.padding_side == "left"
    rng = np.random.default_rng(1)
    chats = [[{"role": "user", "content": [{"type": "image", "image": Image.fromarray(
        rng.integers(0, 256, size, dtype=np.uint8))}, {"type": "text", "text": text}]}]
        for size, text in [((40, 60, 3), "the cat"), ((90, 30, 3), "a dog sat on the red mat by the door")]]
    alone = []
    for chat in chats:
        inputs = proc.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True,
                                          return_tensors="pt")
        with torch.no_grad():
            alone.append(model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1]:])
    inputs = proc.apply_chat_template(chats, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      return_tensors="pt", processor_kwargs={"padding": True})
    assert (inputs["attention_mask"][:, 0] == 0).any()  # one prompt is padded, at its start
    with torch.no_grad():
        batch = model.generate(**inputs, max_new_tokens=6, do_sample=False)[:, inputs["input_ids"].shape[1]:]
    for row, ids in zip(batch, alone):
        assert row[: len(ids)].tolist() == ids.tolist()

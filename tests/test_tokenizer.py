"""Prompt rendering and tokenization agree with the transformers processor."""

import pytest

from glmasr.checkpoint.random_weights import CHAT_TEMPLATE, build_tokenizer
from glmasr.checkpoint.tokenizer import PromptBuilder, TokenizerError

from conftest import noise

SPEC_PROMPT = ("<|user|>\n<|begin_of_audio|><|pad|><|end_of_audio|><|user|>\n"
               "Please transcribe this audio into text<|assistant|>\n")


def test_render_matches_spec_and_chat_template(tiny_asr):
    pb = tiny_asr.prompts
    assert pb.render(1) == SPEC_PROMPT
    from transformers.utils.chat_template_utils import render_jinja_template

    conv = [{"role": "user", "content": [{"type": "audio", "path": "a.wav"},
                                         {"type": "text", "text": "Please transcribe this audio into text"}]}]
    rendered, _ = render_jinja_template(conversations=[conv], chat_template=CHAT_TEMPLATE, add_generation_prompt=True)
    assert rendered[0] == SPEC_PROMPT


def test_special_ids_come_from_the_tokenizer(tiny_asr):
    tok = tiny_asr.prompts.tokenizer
    for name, tid in tiny_asr.prompts.special_ids.items():
        assert tok.convert_ids_to_tokens(tid) == name
    full = PromptBuilder(build_tokenizer(59264), audio_token_id=59260)
    assert full.special_ids["<|user|>"] == 59253 and full.special_ids["<|pad|>"] == 59260


@pytest.mark.parametrize("prompt", [None, "Transcribe, please: 日本語 too"])
def test_ids_match_the_processor(tiny_asr, hf_oracle, prompt):
    processor, _ = hf_oracle
    audio = noise(3.5, 11)
    ref = processor.apply_transcription_request([audio], prompt=prompt)["input_ids"][0].tolist()
    assert tiny_asr.prompts.encode(43, prompt) == ref


def test_tokenizer_that_adds_a_prefix_token(tiny_shipped, tmp_path):
    """A tokenizer with a BOS post-processor: we must add it exactly when the processor does."""
    import shutil

    from tokenizers import processors
    from transformers import AutoProcessor, AutoTokenizer

    folder = tmp_path / "bos"
    shutil.copytree(tiny_shipped, folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    bos_id = tok.convert_tokens_to_ids("<|system|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|system|> $A", special_tokens=[("<|system|>", bos_id)])
    tok.save_pretrained(str(folder))
    processor = AutoProcessor.from_pretrained(str(folder))
    ref = processor.apply_transcription_request([noise(2.0, 3)])["input_ids"][0].tolist()
    pb = PromptBuilder.from_folder(folder, audio_token_id=tok.convert_tokens_to_ids("<|pad|>"))
    ours = pb.encode(ref.count(pb.audio_token_id))
    assert ours[0] == bos_id and ours == ref


def test_prompt_with_placeholder_text_is_rejected(tiny_asr):
    with pytest.raises(TokenizerError, match="audio placeholders"):
        tiny_asr.prompts.encode(3, "say <|pad|>")


def test_audio_token_id_must_match_tokenizer():
    with pytest.raises(TokenizerError, match="audio_token_id"):
        PromptBuilder(build_tokenizer(), audio_token_id=5)


def _folders(tiny_shipped, tiny_transformers):
    from pathlib import Path

    return [tiny_shipped, tiny_transformers, Path(__file__).parent / "fixtures" / "tiny-random-transformers-5.24"]


def test_tokenizers_backend_equals_transformers(tiny_shipped, tiny_transformers):
    """The checkpoint's tokenizer.json run through `tokenizers` (the fast load path) gives transformers'
    AutoTokenizer's ids for every prompt and its text for random token sequences, special ids included."""
    import random

    from glmasr.checkpoint.tokenizer import TokenizersAdapter

    for folder in _folders(tiny_shipped, tiny_transformers):
        fast = PromptBuilder.from_folder(folder, 263)
        ref = PromptBuilder.from_folder(folder, 263, backend="transformers")
        assert isinstance(fast.tokenizer, TokenizersAdapter) and not isinstance(ref.tokenizer, TokenizersAdapter)
        assert fast.special_ids == ref.special_ids
        for n, prompt in [(1, None), (43, "Transcribe, please: 日本語 too"), (375, "  spaces  \n"), (7, "é" * 40)]:
            assert fast.encode(n, prompt) == ref.encode(n, prompt)
        rng = random.Random(5)
        for _ in range(300):
            ids = [rng.randrange(264) for _ in range(rng.randrange(0, 40))]
            assert fast.decode(ids) == ref.decode(ids), (folder, ids)


def test_tokenizer_settings_transformers_applies_use_transformers(tiny_shipped, tmp_path):
    import json
    import shutil

    from glmasr.checkpoint.tokenizer import TokenizersAdapter

    folder = tmp_path / "cleanup"
    shutil.copytree(tiny_shipped, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["clean_up_tokenization_spaces"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    pb = PromptBuilder.from_folder(folder, 263)
    assert not isinstance(pb.tokenizer, TokenizersAdapter)
    with pytest.raises(TokenizerError, match="needs transformers"):
        PromptBuilder.from_folder(folder, 263, backend="tokenizers")

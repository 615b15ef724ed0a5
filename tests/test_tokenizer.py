"""Prompt rendering and tokenization agree with the transformers processor."""

import pytest

from glmasr.random_checkpoint import CHAT_TEMPLATE, build_tokenizer
from glmasr.tokenizer import PromptBuilder, TokenizerError

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

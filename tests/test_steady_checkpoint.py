"""The realtime benchmark's steady checkpoint (``scripts/bench/steady_checkpoint.py``): a copy of a random
checkpoint whose decoder writes " a a a ..." whatever the audio, so that live drafts agree on random weights.

Checked through the real model (``glmasr.load``, the torch backend on the CPU) on fresh random audio of several
lengths: the text is that pattern with exactly the forced number of tokens, two drafts of a growing turn share
their prefix as LocalAgreement needs, and every tensor keeps its shape and dtype (the same work per token).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from glmasr.live.agreement import common_prefix
from scripts.bench import steady_checkpoint as sc


@pytest.fixture(scope="module")
def steady(tiny_shipped, tmp_path_factory):
    return sc.build(tiny_shipped, tmp_path_factory.mktemp("steady") / "tiny-steady")


def test_same_tensors_in_shape_and_dtype_and_only_the_decoder_ends_changed(tiny_shipped, steady):
    src, dst = load_file(str(tiny_shipped / "model.safetensors")), load_file(str(steady / "model.safetensors"))
    assert src.keys() == dst.keys()
    changed = set()
    for k in src:
        assert dst[k].shape == src[k].shape and dst[k].dtype == src[k].dtype, k
        if not torch.equal(dst[k], src[k]):
            changed.add(k)
    layers = {k for k in src if k.startswith("language_model.model.layers.") and k.endswith(sc.ZEROED)}
    assert layers and all(not dst[k].any() for k in layers)
    # the final norm is set to one (already one in a freshly initialised checkpoint)
    assert layers | {sc.EMBED, sc.LM_HEAD} <= changed <= layers | {sc.EMBED, sc.LM_HEAD, sc.NORM}
    assert torch.equal(dst[sc.NORM], torch.ones_like(dst[sc.NORM]))
    # the embedding is the source's apart from its first two dimensions
    assert torch.equal(dst[sc.EMBED][:, 2:], src[sc.EMBED][:, 2:])


def test_the_model_writes_a_a_a_and_drafts_agree(steady):
    import glmasr
    from glmasr.options import DecodeOptions

    asr = glmasr.load(steady, device="cpu", backend="torch")
    try:
        rng = np.random.default_rng()
        ids = []
        for seconds, budget in ((1.0, 3), (2.0, 6), (3.5, 11)):
            audio = (rng.standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)
            r = asr.submit(audio, DecodeOptions(max_new_tokens=budget), sampling_rate=16000).result()
            assert r.text == " ".join(["a"] * (budget // 2)), (seconds, r.text)
            assert len(r.token_ids) == budget
            ids.append(list(r.token_ids))
        # a shorter draft is a prefix of a longer one: what LocalAgreement-2 publishes
        assert common_prefix(ids[0], ids[1]) == len(ids[0]) and common_prefix(ids[1], ids[2]) == len(ids[1])
    finally:
        asr.close()


def test_the_chain_check_refuses_a_broken_head(tiny_shipped):
    space, letter = sc.token_ids(tiny_shipped)
    state = sc.make_steady(load_file(str(tiny_shipped / "model.safetensors")), space, letter)
    sc.check_chain(state, space, letter)
    broken = dict(state)
    head = state[sc.LM_HEAD].clone()
    head[letter, 1] = 0.5  # now weaker than the space row for the space input: " " -> " "
    broken[sc.LM_HEAD] = head
    with pytest.raises(AssertionError, match="argmax chain"):
        sc.check_chain(broken, space, letter)


def test_the_copy_is_reused_until_the_source_changes(tiny_shipped, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_shipped, src)
    dst = sc.steady_copy(src)
    assert dst == tmp_path / "src-steady"
    stamp = (dst / sc._STAMP).read_text()
    mtime = (dst / "model.safetensors").stat().st_mtime_ns
    assert sc.build(src, dst) == dst
    assert (dst / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten
    weights = src / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the source changed
    assert sc.steady_copy(src) == dst
    assert (dst / sc._STAMP).read_text() != stamp  # rebuilt for the new source
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        sc.build(tmp_path / "nothing", tmp_path / "out")

"""A copy of a random checkpoint whose decoder writes `` a a a ...`` whatever the audio, so that live drafts agree.

    python -m scripts.bench.steady_checkpoint SRC DST

Live partials (``interim_results``) publish the token prefix that two consecutive drafts of a growing turn agree on
(``glmasr.live.agreement``). Random weights give unrelated token streams for 1 s and 2 s of audio, so nothing is
ever agreed and a load test on them cannot measure the partial interval, nor the shorter finals that continue from
agreed text. Speech gives drafts that mostly agree; this checkpoint gives drafts that always do, with every tensor
the same shape, dtype and (for the kernels) the same amount of work as the source's, so timing is unchanged.

The decoder's output is made a function of its last input token only, with the same answer for every token but
one:

- every layer's ``o_proj`` and ``down_proj`` are zero, so the residual stream is the input token's embedding (the
  attention and MLP still run in full);
- the final norm's weight is one; every embedding row gets ``beta`` in dimension 0; dimension 1 is zero except in
  the row of the space token S, where it is ``beta`` too;
- the lm head is zero except two rows: S reads dimension 0 (logit ``beta / rms`` > 0 for every input, all other
  logits 0 or less) and ``a`` reads dimension 1 twice as strongly (logit ``2 beta / rms`` only when the input is S).

So the next token after S is ``a`` and after anything else S: every prompt decodes `` a a a ...`` until its budget
(``scripts.bench.forced_serve`` forces ~3 tokens per second of audio), consecutive drafts agree on all but their
last word, and EOS never wins. The argmax margins are exact by construction (``check_chain`` verifies them on the
written tensors, in their dtype).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

_STAMP = "glmasr-steady-checkpoint.json"
FORMAT = 1
EMBED = "language_model.model.embed_tokens.weight"
LM_HEAD = "language_model.lm_head.weight"
NORM = "language_model.model.norm.weight"
ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def token_ids(folder: Path) -> tuple[int, int]:
    """(space, ``a``): the ids of the checkpoint tokenizer's single-token texts " " and "a"."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = []
    for text in (" ", "a"):
        enc = tok.encode(text, add_special_tokens=False)
        if len(enc) != 1 or tok.decode(enc) != text:
            raise ValueError(f"{folder}: the tokenizer has no single token for {text!r} (got {enc})")
        ids.append(enc[0])
    return ids[0], ids[1]


def make_steady(state: dict[str, torch.Tensor], space: int, letter: int) -> dict[str, torch.Tensor]:
    """``state`` (shipped key names) changed as the module docstring says; tensors keep their dtype and shape."""
    if LM_HEAD not in state:
        raise KeyError(f"the checkpoint has no {LM_HEAD} (a tied lm head cannot be steered apart from the embedding)")
    out = dict(state)
    embed = state[EMBED].float().clone()
    beta = 4.0 * float(embed[:, 2:].std())
    embed[:, 0] = beta
    embed[:, 1] = 0.0
    embed[space, 1] = beta
    head = torch.zeros_like(embed)
    head[space, 0] = 1.0
    head[letter, 1] = 2.0
    out[EMBED] = embed.to(state[EMBED].dtype)
    out[LM_HEAD] = head.to(state[LM_HEAD].dtype)
    out[NORM] = torch.ones_like(state[NORM])
    n = 0
    for key, value in state.items():
        if key.startswith("language_model.model.layers.") and key.endswith(ZEROED):
            out[key] = torch.zeros_like(value)
            n += 1
    if n == 0:
        raise KeyError("no decoder o_proj / down_proj weights found under language_model.model.layers.")
    return out


def check_chain(state: dict[str, torch.Tensor], space: int, letter: int, eps: float = 1e-5) -> None:
    """Every input token's next token is the one the docstring says, with a margin that survives the dtype."""
    embed, head = state[EMBED].float(), state[LM_HEAD].float()
    h = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + eps) * state[NORM].float()
    rows = torch.nonzero(head.abs().sum(-1)).flatten().tolist()
    if sorted(rows) != sorted({space, letter}):
        raise AssertionError(f"lm head rows {rows} are not just {space} and {letter}")
    logit_space, logit_letter = h @ head[space], h @ head[letter]
    want = torch.full((embed.shape[0],), space)
    want[space] = letter
    got = torch.where(logit_letter > logit_space, letter, space)
    top = torch.maximum(logit_space, logit_letter)
    second = torch.clamp(torch.minimum(logit_space, logit_letter), min=0.0)  # every other row's logit is 0
    if not torch.equal(got, want) or bool((top - second < 1.0).any()):
        raise AssertionError("the steady checkpoint's argmax chain does not hold")


def build(src: str | Path, dst: str | Path) -> Path:
    """Write the steady copy of ``src`` to ``dst`` (reused when its stamp matches ``src``'s weights file)."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} does not exist (a steady copy needs a single-file random checkpoint)")
    stat = weights.stat()
    stamp = {"format": FORMAT, "source": str(src.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        if json.loads((dst / _STAMP).read_text()) == stamp and (dst / "model.safetensors").is_file():
            return dst
    except (OSError, ValueError):
        pass
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", _STAMP):
            shutil.copy2(f, dst / f.name)
    space, letter = token_ids(src)
    state = make_steady(load_file(str(weights)), space, letter)
    check_chain(state, space, letter)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / _STAMP).write_text(json.dumps(stamp))
    return dst


def steady_copy(folder: str | Path) -> Path:
    """The steady copy of ``folder`` next to it (``<folder>-steady``), built once."""
    folder = Path(folder)
    return build(folder, folder.parent / f"{folder.name}-steady")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    print(build(sys.argv[1], sys.argv[2]))

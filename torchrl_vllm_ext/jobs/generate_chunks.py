"""One chunk of ``torchrl-vllm generate``: rows -> policy input, policy output -> stored fields.

The policy pads each chunk to that chunk's own widths; the output directory holds every
row at fixed widths (longest prompt of the input, ``max_tokens``), so each field is
re-padded here into the ``[left pad | prompt | response | right pad]`` layout.

>>> import torch
>>> from torchrl_vllm_ext.jobs.generate_chunks import place
>>> place(torch.tensor([[1, 2]]), 4, fill=0, left=True)
tensor([[0, 0, 1, 2]])
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict

from torchrl_vllm_ext.jobs.generate_io import Prompts
from torchrl_vllm_ext.jobs.generate_store import Layout


def place(x: torch.Tensor, width: int, fill, left: bool) -> torch.Tensor:
    """``x`` padded on its last dim to ``width``, on the left (prompts) or right (responses)."""
    if x.shape[-1] > width:
        raise ValueError(f"a field of width {x.shape[-1]} does not fit the output's {width}")
    out = x.new_full((*x.shape[:-1], width), fill)
    if left:
        out[..., width - x.shape[-1] :] = x
    else:
        out[..., : x.shape[-1]] = x
    return out


def policy_input(prompts: Prompts, lo: int, hi: int, pad: int, seed: int) -> TensorDict:
    """Rows ``[lo, hi)`` as a padded token batch with its mask and one seed per row."""
    ids = prompts.token_ids[lo:hi]
    lengths = prompts.lengths[lo:hi]
    width = int(lengths.max())
    tokens = np.full((hi - lo, width), pad, dtype=np.int64)
    mask = np.arange(width)[None, :] < lengths[:, None]
    tokens[mask] = np.concatenate(ids)
    return TensorDict(
        {
            ("tokens", "prompt"): torch.from_numpy(tokens),
            ("masks", "all_attention_mask"): torch.from_numpy(mask),
            # Seeded by row index: the output does not depend on chunking or resumption.
            "seed": torch.arange(lo, hi, dtype=torch.int64) + seed,
        },
        batch_size=[hi - lo],
    )


def chunk_output(
    result: TensorDict,
    prompts: Prompts,
    lo: int,
    hi: int,
    layout: Layout,
    tokenizer,
    pad: int,
) -> tuple[dict, dict[str, list], int]:
    """The policy's padded output -> (tensor fields at the output's widths, strings, tokens)."""
    wp, t = layout.prompt_width, layout.max_tokens
    prompt = result.get(("tokens", "prompt"))
    response = result.get(("tokens", "response"))
    w = prompt.shape[-1]
    attention = result.get(("masks", "all_attention_mask"))
    p_mask, r_mask = attention[..., :w], attention[..., w:]
    P = place(prompt, wp, pad, left=True)
    R = place(response, t, pad, left=False)
    Mp = place(p_mask, wp, False, left=True)
    Mr = place(r_mask, t, False, left=False)
    lp_full = result.get(("log_probs", "full"))
    LPp = place(lp_full[..., :w], wp, 0.0, left=True)
    LPr = place(result.get(("log_probs", "response")), t, 0.0, left=False)
    batch = P.shape[:-1]
    tensors = {
        ("tokens", "prompt"): P,
        ("tokens", "response"): R,
        ("tokens", "full"): torch.cat([P, R], -1),
        ("log_probs", "response"): LPr,
        ("log_probs", "full"): torch.cat([LPp, LPr], -1),
        ("masks", "all_attention_mask"): torch.cat([Mp, Mr], -1),
        ("masks", "all_assistant_mask"): torch.cat([torch.zeros_like(Mp), Mr], -1),
        "row": torch.arange(lo, hi).reshape(-1, *[1] * (len(batch) - 1)).expand(batch),
    }
    g = layout.samples
    flat_resp = response.reshape(-1, response.shape[-1])
    lengths = r_mask.reshape(flat_resp.shape).sum(-1).tolist()
    replies = tokenizer.batch_decode(
        [r[:n].tolist() for r, n in zip(flat_resp, lengths, strict=True)],
        skip_special_tokens=False,
        clean_up_tokenization_spaces=False,
    )
    if prompts.texts is not None:
        prompt_texts = prompts.texts[lo:hi]
    else:
        prompt_texts = tokenizer.batch_decode(
            [x.tolist() for x in prompts.token_ids[lo:hi]],
            skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )
    per_sample = [p for p in prompt_texts for _ in range(g)]
    strings = {
        "text.prompt": per_sample,
        "text.response": replies,
        "text.full": [p + r for p, r in zip(per_sample, replies, strict=True)],
        "vllm.weight_version": _flat(result.get(("vllm", "weight_version")).tolist()),
        "vllm.finish_reason": _flat(result.get(("vllm", "finish_reason")).tolist()),
    }
    if prompts.ids is not None:
        strings["id"] = [i for i in prompts.ids[lo:hi] for _ in range(g)]
    if g > 1:  # one list of G samples per row, like the output's (N, G) batch
        strings = {k: [v[i : i + g] for i in range(0, len(v), g)] for k, v in strings.items()}
    return tensors, strings, int(Mr.sum())


def _flat(values) -> list:
    out = []
    for v in values if isinstance(values, list) else [values]:
        out.extend(_flat(v) if isinstance(v, list) else [v])
    return out

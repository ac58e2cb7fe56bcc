"""What a request carries for its images, and the placeholder expansion.

A prompt names each image once with a single `<|media_pad|>` token (the chat template writes
`<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`); `expand_placeholders`
replaces the k-th one with image k's N tokens and records where they start (`offset`). A
prompt that already holds the expanded run (N placeholders in a row, as transformers' processor
writes it) is taken as is.

Invariant: after expansion, `prompt[img.offset : img.offset + img.num_tokens]` are all the
placeholder id, the images are in prompt order and do not overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from k2serve.multimodal.image import ProcessedImage


@dataclass(frozen=True)
class ImageInput:
    pixel_values: torch.Tensor  # [h * w, 3, patch, patch] float32 (host)
    grid_hw: tuple[int, int]
    num_tokens: int
    mm_hash: str
    offset: int = -1  # first placeholder position in the prompt (set by expand_placeholders)

    @classmethod
    def from_processed(cls, p: ProcessedImage) -> ImageInput:
        return cls(p.pixel_values, p.grid_hw, p.num_tokens, p.mm_hash)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def expand_placeholders(
    token_ids: list[int], placeholder_id: int, images: list[ImageInput]
) -> tuple[list[int], list[ImageInput]]:
    """(expanded token ids, images with their offsets); ValueError when the prompt's
    placeholders do not match the images."""
    runs: list[tuple[int, int]] = []  # (start, length) of each run of placeholders
    i, n = 0, len(token_ids)
    while i < n:
        if token_ids[i] == placeholder_id:
            j = i
            while j < n and token_ids[j] == placeholder_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    if len(runs) != len(images):
        raise ValueError(
            f"the prompt has {len(runs)} image placeholder(s) (<|media_pad|>) but "
            f"{len(images)} image(s) were given: write the placeholder once per image"
        )
    out: list[int] = []
    placed: list[ImageInput] = []
    prev = 0
    for (start, length), img in zip(runs, images, strict=True):
        if length not in (1, img.num_tokens):
            raise ValueError(
                f"an image placeholder run has {length} tokens; give one <|media_pad|> per image "
                f"(this image takes {img.num_tokens})"
            )
        out.extend(token_ids[prev:start])
        placed.append(replace(img, offset=len(out)))
        out.extend([placeholder_id] * img.num_tokens)
        prev = start + length
    out.extend(token_ids[prev:])
    return out, placed


def page_extra_keys(images: list[ImageInput], start: int, end: int, salt: str | None) -> str | None:
    """The prefix-cache extra key of the page holding positions [start, end): the salt plus
    the hash of every image with a token in it (so the same text with another image never hits,
    and the same image at the same place does)."""
    hashes = [img.mm_hash for img in images if img.offset < end and img.end > start]
    if not hashes:
        return salt
    return "|".join([salt or "", *hashes])

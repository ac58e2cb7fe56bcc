"""Images in chat / Responses requests (K2.5): find them, fetch them, decode them.

`image_refs` lists a request's image parts in prompt order (`image_url`, `input_image`; a
video part is a 400); `template_content` gives the chat template a message's parts with each
image as a `{"type": "image"}` marker (the template writes the placeholder); `load_images`
checks the count against `--limit-mm-per-prompt` before fetching anything, fetches the URLs
concurrently under the server's `MediaPolicy` (multimodal.media) and decodes them in the CPU
pool (never on the event loop). Every problem is a 400 naming the part.
"""

from __future__ import annotations

import asyncio

from k2serve.multimodal.image import ImageError, load_image
from k2serve.multimodal.media import MediaPolicy, fetch_image_bytes, part_image_ref
from k2serve.server.errors import bad_request

_TEXT_PARTS = ("text", "input_text")


def _part_dict(part) -> dict:
    return part if isinstance(part, dict) else part.model_dump(exclude_none=True)


def image_refs(messages) -> list[tuple[str, str]]:
    """[(url, param path)] of every image part, in order."""
    refs = []
    for i, m in enumerate(messages):
        content = m.content if hasattr(m, "content") else m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            d = _part_dict(part)
            where = f"messages.{i}.content.{j}"
            try:
                ref = part_image_ref(d)
            except ImageError as e:
                raise bad_request(str(e), param=f"{where}.type") from None
            if ref is None:
                if d.get("type") not in _TEXT_PARTS:
                    raise bad_request(
                        f"messages[{i}].content[{j}].type={d.get('type')!r} is not supported "
                        "(text, image_url)",
                        param=f"{where}.type",
                    )
                continue
            if not isinstance(ref, str):
                raise bad_request("an image part needs a URL string", param=f"{where}.image_url")
            refs.append((ref, where))
    return refs


def template_content(content, i: int):
    """A message's content for the chat template: a string when it is text only, else parts
    with each image as {"type": "image"}."""
    if content is None or isinstance(content, str):
        return content
    parts, has_image = [], False
    for part in content:
        d = _part_dict(part)
        if d.get("type") in _TEXT_PARTS:
            parts.append({"type": "text", "text": d.get("text") or ""})
        else:
            parts.append({"type": "image"})
            has_image = True
    if not has_image:
        return "".join(p["text"] for p in parts)
    return parts


async def load_images(state, refs: list[tuple[str, str]]) -> list:
    """Fetch and decode the images (PIL, in order); 400 on any problem."""
    if not refs:
        return []
    mm = getattr(getattr(state.engine, "engine", None), "mm", None)
    if mm is None or not mm.enabled:
        raise bad_request(
            "this model takes no images (its config.json has no vision_config)",
            param=f"{refs[0][1]}.type",
        )
    try:
        mm.check_count(len(refs))
    except ValueError as e:
        raise bad_request(str(e), param="messages") from None
    policy: MediaPolicy = getattr(state, "media_policy", None) or MediaPolicy()

    async def one(url: str, where: str):
        try:
            data = await fetch_image_bytes(url, policy)
            return await state.cpu.run(load_image, data)
        except ImageError as e:
            raise bad_request(f"{where}: {e}", param=where) from None

    return list(await asyncio.gather(*(one(u, w) for u, w in refs)))


def process_images(state, prompt_ids: list[int], images: list) -> tuple[list[int], list]:
    """Expand the prompt's placeholders for the images (in the CPU pool: preprocessing)."""
    if not images:
        return prompt_ids, []
    mm = state.engine.engine.mm
    try:
        return mm.process(prompt_ids, images)
    except ValueError as e:
        raise bad_request(str(e), param="messages") from None

"""The engine's side of K2.5 images: request-time checks and the step's encoder outputs.

- `MultiModalInputs` (one per engine): the image processor of the checkpoint
  (preprocessor_config.json), the placeholder id, `--limit-mm-per-prompt`; turns a prompt and
  its images into expanded token ids + placed `ImageInput`s (`process`), and checks placed
  inputs handed in by the server (`check_placed`).
- `EncoderCache` (one per runner): runs the vision encoder once per image content hash and
  keeps the outputs (least recently used first out, bounded in tokens), so a chunked prefill that
  splits an image's run of tokens over steps, or two requests with the same image, encode it once;
  `step_embeddings` gives the (flat-batch rows, embeddings) of the step's image tokens.
Invariant: correctness never depends on a cache hit: an evicted image is encoded again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch

from k2serve.memory import encoder_cache_tokens, encoder_max_patches
from k2serve.multimodal.image import ImageError, ImageProcessor, ProcessedImage
from k2serve.multimodal.inputs import ImageInput, expand_placeholders
from k2serve.vision_config import ImageProcessorConfig

logger = logging.getLogger(__name__)


class MultiModalInputs:
    def __init__(
        self, processor: ImageProcessor | None, placeholder_id: int | None, max_images: int
    ) -> None:
        self.processor = processor
        self.placeholder_id = placeholder_id
        self.max_images = max_images

    @classmethod
    def for_model(cls, model_config, model_dir, engine_config) -> MultiModalInputs:
        from k2serve.engine.config import parse_mm_limits

        limits = parse_mm_limits(engine_config.limit_mm_per_prompt)
        vc = getattr(model_config, "vision", None)
        if vc is None:
            if engine_config.limit_mm_per_prompt or engine_config.mm_encoder_tp_mode != "weights":
                logger.info(
                    "--limit-mm-per-prompt / --mm-encoder-tp-mode do nothing here: the model "
                    "has no vision tower (no vision_config in config.json)"
                )
            return cls(None, None, 0)
        if (
            engine_config.tensor_parallel_size == 1
            and engine_config.mm_encoder_tp_mode != "weights"
        ):
            logger.info("--mm-encoder-tp-mode does nothing with one rank (-tp 1)")
        proc = ImageProcessor(ImageProcessorConfig.from_dir(model_dir))
        return cls(proc, vc.media_placeholder_token_id, limits["image"])

    @property
    def enabled(self) -> bool:
        return self.processor is not None

    def check_count(self, n: int) -> None:
        if n and not self.enabled:
            raise ValueError("this model takes no images (its config.json has no vision_config)")
        if n > self.max_images:
            raise ValueError(
                f"{n} images in one prompt; at most {self.max_images} are allowed "
                "(--limit-mm-per-prompt)"
            )

    def preprocess(self, image) -> ImageInput:
        """A PIL image, a ProcessedImage or an ImageInput -> an (unplaced) ImageInput."""
        if isinstance(image, ImageInput):
            return image
        if isinstance(image, ProcessedImage):
            return ImageInput.from_processed(image)
        assert self.processor is not None
        if not hasattr(image, "getbands"):
            raise ValueError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
        w, h = image.size
        if w <= 0 or h <= 0:
            raise ImageError(f"the image has no pixels ({w}x{h})")
        return ImageInput.from_processed(self.processor(image))

    def process(self, token_ids: list[int], images: Sequence) -> tuple[list[int], list[ImageInput]]:
        """Expand the prompt's placeholders (one per image) for `images`; ValueError if the
        model has no tower, too many images, or placeholders and images do not match."""
        self.check_count(len(images))
        if not images:
            return token_ids, []
        inputs = [self.preprocess(im) for im in images]
        assert self.placeholder_id is not None
        return expand_placeholders(token_ids, self.placeholder_id, inputs)

    def check_placed(self, token_ids: list[int], inputs: list[ImageInput]) -> None:
        self.check_count(len(inputs))
        prev = 0
        for img in inputs:
            if img.offset < prev or img.end > len(token_ids):
                raise ValueError("image inputs overlap or lie outside the prompt")
            if any(t != self.placeholder_id for t in token_ids[img.offset : img.end]):
                raise ValueError(
                    f"the prompt does not hold the image's {img.num_tokens} placeholder tokens "
                    f"at position {img.offset}"
                )
            prev = img.end
        if inputs:
            n_ph = sum(1 for t in token_ids if t == self.placeholder_id)
            if n_ph != sum(img.num_tokens for img in inputs):
                raise ValueError(
                    f"the prompt has {n_ph} image placeholder tokens but the images take "
                    f"{sum(img.num_tokens for img in inputs)}"
                )


MMItem = tuple[int, ImageInput, int, int]  # (flat-batch row, image, first token, end token)


def step_items(scheduled: Sequence[tuple[object, int]]) -> list[MMItem]:
    """The image tokens among a step's scheduled tokens (flat batch in `scheduled` order):
    one item per (request, image) overlap, with the image's token range [lo, hi) it covers."""
    items: list[MMItem] = []
    flat = 0
    for req, n in scheduled:
        mm = getattr(req, "mm_inputs", None)
        if mm:
            start = req.num_computed_tokens  # type: ignore[attr-defined]
            for img in mm:
                lo, hi = max(start, img.offset), min(start + n, img.end)
                if lo < hi:
                    items.append((flat + lo - start, img, lo - img.offset, hi - img.offset))
        flat += n
    return items


class EncoderCache:
    """Vision encoder outputs by image content hash, LRU, at most `max_tokens` tokens held.

    With tensor parallelism every rank keeps one and sees the same steps, so the caches stay
    identical; `tp` = (rank, world_size, group) with mode "data" splits each step's new images
    over the ranks (image j on rank j % world_size) and all-gathers the embeddings; "weights"
    (and one rank) encodes them all here. NOTE: the tower's weights are replicated, not sharded.
    """

    def __init__(
        self, model, max_tokens: int = 65536, tp=None, mode: str = "weights",
        max_patches: int = 1 << 62,
    ) -> None:  # fmt: skip
        """`max_tokens`: encoder outputs kept; `max_patches`: the most patches one tower call
        takes (memory.encoder_max_patches)."""
        self.model = model
        self.max_tokens = max_tokens
        self.max_patches = max_patches
        self.tp = tp  # (rank, world_size, torch.distributed group) or None
        self.mode = mode
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()  # hash -> [n, hidden]
        self._tokens = 0
        self.num_encoded = 0  # images run through the tower here (for tests and metrics)

    @classmethod
    def for_step_budget(
        cls, model, max_num_batched_tokens: int, tp=None, mode: str = "weights"
    ) -> EncoderCache:
        """Sized as `k2serve.memory` (and so the planner) budgets it for steps of at most
        `max_num_batched_tokens` tokens."""
        return cls(
            model,
            encoder_cache_tokens(max_num_batched_tokens),
            tp=tp,
            mode=mode,
            max_patches=encoder_max_patches(model.config, max_num_batched_tokens),
        )

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._cache

    def _put(self, mm_hash: str, emb: torch.Tensor) -> None:
        self._cache[mm_hash] = emb
        self._tokens += emb.shape[0]
        while self._tokens > self.max_tokens and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._tokens -= old.shape[0]

    def _run(self, imgs: list[ImageInput]) -> list[torch.Tensor]:
        """The tower over `imgs`, in calls of at most `max_patches` patches each (one image at
        least), so its working memory stays what the plan reserved whatever a step holds."""
        out: list[torch.Tensor] = []
        start = 0
        while start < len(imgs):
            end, patches = start + 1, imgs[start].pixel_values.shape[0]
            while end < len(imgs) and patches + imgs[end].pixel_values.shape[0] <= self.max_patches:
                patches += imgs[end].pixel_values.shape[0]
                end += 1
            part = imgs[start:end]
            pv = torch.cat([img.pixel_values for img in part])  # [N, 3, p, p]
            out.extend(self.model.encode_images(pv, [img.grid_hw for img in part]))
            start = end
        self.num_encoded += len(imgs)
        return out

    def _run_data_parallel(self, imgs: list[ImageInput]) -> list[torch.Tensor]:
        """Rank r encodes images r, r + W, ...; an all-gather of the padded shares gives every
        rank all embeddings (a rank with no image this step still joins the collective)."""
        import torch.distributed as dist

        rank, world, group = self.tp
        mine = imgs[rank::world]
        embs = self._run(mine) if mine else []
        dev, dt = self.model.device, self.model.dtype
        hidden = self.model.config.hidden_size
        shares = [sum(i.num_tokens for i in imgs[r::world]) for r in range(world)]
        width = max(shares)
        local = torch.zeros(width, hidden, device=dev, dtype=dt)
        if embs:
            local[: shares[rank]] = torch.cat(embs).to(dt)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=group)
        out: list[torch.Tensor] = [torch.empty(0)] * len(imgs)
        for r in range(world):
            pos = 0
            for j in range(r, len(imgs), world):
                n = imgs[j].num_tokens
                out[j] = gathered[r][pos : pos + n]
                pos += n
        return out

    def encode(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Each image's embeddings [num_tokens, hidden]; the tower runs once, batched, over
        the images not cached yet."""
        out: dict[str, torch.Tensor] = {}
        todo: dict[str, ImageInput] = {}
        for img in images:
            if img.mm_hash in self._cache:
                self._cache.move_to_end(img.mm_hash)
                out[img.mm_hash] = self._cache[img.mm_hash]
            else:
                todo.setdefault(img.mm_hash, img)
        if not todo:
            return out
        imgs = list(todo.values())
        split = self.tp is not None and self.mode == "data" and self.tp[1] > 1
        embs = self._run_data_parallel(imgs) if split else self._run(imgs)
        for img, emb in zip(imgs, embs, strict=True):
            if emb.shape[0] != img.num_tokens:
                raise RuntimeError(f"the encoder gave {emb.shape[0]} tokens for {img.num_tokens}")
            self._put(img.mm_hash, emb)
            out[img.mm_hash] = emb
        return out

    def embeddings(self, items: list[MMItem]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows [M] long, embeddings [M, hidden]) for a step's items, or None."""
        if not items:
            return None
        embs = self.encode([img for _, img, _, _ in items])
        rows, parts = [], []
        for row, img, lo, hi in items:
            rows.append(torch.arange(row, row + hi - lo))
            parts.append(embs[img.mm_hash][lo:hi])
        return torch.cat(rows).to(parts[0].device), torch.cat(parts)

    def step_embeddings(
        self, scheduled: Sequence[tuple[object, int]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`embeddings(step_items(scheduled))`: one rank's step."""
        return self.embeddings(step_items(scheduled))

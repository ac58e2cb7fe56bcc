"""Image decoding and the Kimi_K25ImageProcessor preprocessing, without torchvision.

Invariants (each checked against transformers in tests/multimodal):
- Mode conversion as transformers' `convert_to_rgb`: anything with transparency is composited
  on white, everything else goes through PIL's `convert("RGB")` (L, P, CMYK, I;16, ...).
- Size: `navit_resize` (scale = min(1, sqrt(in_patch_limit / patches), side limits): never
  upscaled), then bicubic with antialias exactly as torchvision resizes a uint8 tensor (float32
  interpolate, clamp to [0, 255], round), then zero-padded at the bottom/right to multiples of
  patch * merge (28); padding pixels normalise to -1.
- Normalisation: (x - 255 mean) / (255 std) in float32; patches row-major over the (h, w)
  patch grid as [h * w, 3, 14, 14]; tokens = h * w / merge^2.
- `load_image` applies the EXIF orientation and refuses what is not a decodable image, a
  0-pixel image, a side over `max_side` pixels or more than `max_pixels` pixels (decompression
  bombs are refused from the header, before the pixels are decoded).
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from k2serve.vision_config import ImageProcessorConfig

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # 8192 x 8192: above this an image is refused
MAX_IMAGE_SIDE = 32768


class ImageError(ValueError):
    """An image that cannot be used; the message says why (HTTP 400)."""


def navit_resize(
    height: int, width: int, patch_size: int, merge: int, max_patches: int, max_side: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)) as Kimi_K25ImageProcessor computes them."""
    ph = max(1.0, height // patch_size)
    pw = max(1.0, width // patch_size)
    scale = min(
        1.0,
        math.sqrt(max_patches / (ph * pw)),
        (max_side * patch_size) / height,
        (max_side * patch_size) / width,
    )
    nh, nw = max(1, int(height * scale)), max(1, int(width * scale))
    nh, nw = min(nh, max_side * patch_size), min(nw, max_side * patch_size)
    factor = merge * patch_size
    return (nh, nw), ((factor - nh % factor) % factor + nh, (factor - nw % factor) % factor + nw)


def to_rgb_array(image) -> np.ndarray:
    """PIL image -> [H, W, 3] uint8, as transformers' convert_to_rgb does it."""
    from PIL import Image

    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(background, rgba).convert("RGB")
    else:
        rgb = image.convert("RGB")
    return np.asarray(rgb, dtype=np.uint8)


def image_hash(rgb: np.ndarray) -> str:
    """Content hash of the decoded RGB pixels (the same picture in PNG or JPEG-as-PNG twice
    hashes the same; a different picture never collides in practice)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(rgb.shape, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(rgb).tobytes())
    return h.hexdigest()


@dataclass
class ProcessedImage:
    pixel_values: torch.Tensor  # [h * w, 3, patch, patch] float32
    grid_hw: tuple[int, int]  # patch grid (h, w), both multiples of merge
    num_tokens: int  # h * w / merge^2: the <|media_pad|> tokens it takes
    mm_hash: str


class ImageProcessor:
    """Kimi_K25ImageProcessor (transformers) / KimiK25VisionProcessor (the checkpoint's)."""

    def __init__(self, config: ImageProcessorConfig | None = None) -> None:
        self.config = config or ImageProcessorConfig()

    def grid(self, height: int, width: int) -> tuple[int, int]:
        c = self.config
        _, (ph, pw) = navit_resize(
            height, width, c.patch_size, c.merge_kernel_size, c.in_patch_limit,
            c.patch_limit_on_one_side,
        )  # fmt: skip
        return ph // c.patch_size, pw // c.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        h, w = self.grid(height, width)
        return h * w // self.config.merge_kernel_size**2

    def __call__(self, image) -> ProcessedImage:
        """A PIL image (any mode) -> its patches, grid, token count and hash."""
        rgb = to_rgb_array(image)
        if rgb.size == 0:
            raise ImageError("the image has no pixels")
        return self.from_rgb(rgb)

    def from_rgb(self, rgb: np.ndarray) -> ProcessedImage:
        c = self.config
        height, width = rgb.shape[:2]
        (nh, nw), (ph, pw) = navit_resize(
            height, width, c.patch_size, c.merge_kernel_size, c.in_patch_limit,
            c.patch_limit_on_one_side,
        )  # fmt: skip
        if not rgb.flags.writeable or not rgb.flags.c_contiguous:
            rgb = np.array(rgb, order="C")
        x = torch.from_numpy(rgb).permute(2, 0, 1)  # [3, H, W] uint8
        if (nh, nw) != (height, width):
            # torchvision's uint8 bicubic: float32, antialiased interpolate, clamp, round
            y = F.interpolate(
                x[None].float(), size=(nh, nw), mode="bicubic", align_corners=False,
                antialias=True,
            )[0]  # fmt: skip
            x = y.clamp_(0, 255).round_().to(torch.uint8)
        if (ph, pw) != (nh, nw):
            x = F.pad(x, (0, pw - nw, 0, ph - nh), value=0)  # [3, ph, pw]
        mean = torch.tensor(c.image_mean) * (1.0 / (1 / 255))
        std = torch.tensor(c.image_std) * (1.0 / (1 / 255))
        xf = x.to(torch.float32).sub_(mean[:, None, None]).div_(std[:, None, None])
        p = c.patch_size
        gh, gw = ph // p, pw // p
        patches = (
            xf.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
        )  # [h*w, 3, p, p]
        tokens = gh * gw // c.merge_kernel_size**2
        return ProcessedImage(patches.contiguous(), (gh, gw), tokens, image_hash(rgb))


def load_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS, max_side: int = MAX_IMAGE_SIDE):
    """Encoded bytes -> an oriented PIL image with its pixels loaded; ImageError otherwise."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not data:
        raise ImageError("the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w <= 0 or h <= 0:
                raise ImageError(f"the image has no pixels ({w}x{h})")
            if w * h > max_pixels or max(w, h) > max_side:
                raise ImageError(
                    f"the image is too large ({w}x{h} pixels; at most {max_pixels} pixels and "
                    f"{max_side} per side)"
                )
            img.load()
            oriented = ImageOps.exif_transpose(img)
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"the image is too large (decompression bomb): {e}") from None
    except UnidentifiedImageError:
        raise ImageError("the data is not an image in a format Pillow reads") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"the image is corrupt or truncated: {e}") from None
    return oriented

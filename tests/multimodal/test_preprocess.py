"""Preprocessing identical to transformers' Kimi_K25ImageProcessor.

torchvision does not import on these CPU machines, so the processor itself runs only in
`test_real_processor` (skipped without torchvision). Elsewhere the reference is transformers'
own code where it can be run: `navit_resize` is executed from the processor's source file, and
`convert_to_rgb` is imported; the resize is torchvision's uint8 bicubic rule (float32,
antialiased interpolate, clamp, round) and the padding / normalisation / patch order are
written out here with numpy.
"""

from __future__ import annotations

import ast
import io
import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from k2serve.multimodal.image import ImageError, ImageProcessor, load_image
from k2serve.vision_config import ImageProcessorConfig

transformers = pytest.importorskip("transformers")


def _navit_resize_from_transformers():
    src = (
        pathlib.Path(transformers.__file__).parent / "models/kimi_k25/image_processing_kimi_k25.py"
    )
    tree = ast.parse(src.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    ns: dict = {"math": __import__("math")}
    exec(compile(ast.Module([fn], []), str(src), "exec"), ns)
    return ns["navit_resize"]


NAVIT = _navit_resize_from_transformers()


def reference(img: Image.Image, cfg: ImageProcessorConfig = ImageProcessorConfig()):
    from transformers.image_transforms import convert_to_rgb

    rgb = convert_to_rgb(img, return_numpy=True)  # [H, W, 3] uint8
    h, w = rgb.shape[:2]
    (nh, nw), (ph, pw) = NAVIT(h, w, cfg.patch_size, cfg.merge_kernel_size, cfg.in_patch_limit,
                               cfg.patch_limit_on_one_side)  # fmt: skip
    x = torch.from_numpy(np.array(rgb)).permute(2, 0, 1)
    if (nh, nw) != (h, w):
        y = F.interpolate(x[None].float(), size=(nh, nw), mode="bicubic", antialias=True)[0]
        x = y.clamp(0, 255).round().to(torch.uint8)
    padded = np.zeros((3, ph, pw), dtype=np.float32)
    padded[:, :nh, :nw] = x.numpy()
    norm = (padded - 127.5) / 127.5
    p = cfg.patch_size
    gh, gw = ph // p, pw // p
    patches = norm.reshape(3, gh, p, gw, p).transpose(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
    return torch.from_numpy(np.ascontiguousarray(patches)), (gh, gw)


MODES = ["RGB", "RGBA", "L", "LA", "P", "CMYK", "I;16", "1"]


def _image(rng, w, h, mode) -> Image.Image:
    arr = rng.integers(0, 256, size=(h, w, 4), dtype=np.uint8)
    base = Image.fromarray(arr, "RGBA")
    if mode == "P":
        return base.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE)
    if mode == "I;16":
        return Image.fromarray(arr[..., 0]).convert("I").convert("I;16")
    return base.convert(mode)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    w=st.integers(1, 700),
    h=st.integers(1, 700),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(w, h, mode, seed):
    img = _image(np.random.default_rng(seed), w, h, mode)
    got = ImageProcessor()(img)
    want, grid = reference(img)
    assert got.grid_hw == grid
    assert got.num_tokens == grid[0] * grid[1] // 4
    torch.testing.assert_close(got.pixel_values, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "h, w",
    [(28, 28), (1, 1), (100000, 1), (1, 30000), (7168, 7169), (4000, 3000), (13, 27), (1024, 1024)],
)
def test_grid_and_token_count(h, w):
    """Sizes at every limit: the token count follows transformers' navit_resize."""
    proc = ImageProcessor()
    _, (ph, pw) = NAVIT(h, w, 14, 2, 16384, 512)
    assert proc.grid(h, w) == (ph // 14, pw // 14)
    gh, gw = proc.grid(h, w)
    assert gh % 2 == gw % 2 == 0 and gh * gw <= 16384 + 2 * (gh + gw) and max(gh, gw) <= 512


def test_small_config_limits():
    cfg = ImageProcessorConfig(in_patch_limit=64, patch_limit_on_one_side=10)
    rng = np.random.default_rng(0)
    for w, h in ((300, 200), (50, 500), (140, 140)):
        img = _image(rng, w, h, "RGB")
        got = ImageProcessor(cfg)(img)
        want, grid = reference(img, cfg)
        assert got.grid_hw == grid
        torch.testing.assert_close(got.pixel_values, want, rtol=0, atol=1e-6)


def test_never_upscaled_and_padding_is_minus_one():
    img = Image.new("RGB", (30, 20), (255, 255, 255))
    got = ImageProcessor()(img)
    assert got.grid_hw == (2, 4)  # 20 -> 28, 30 -> 56: padded, not resized
    pix = got.pixel_values.reshape(2, 4, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 28, 56)
    assert torch.all(pix[:, :20, :30] == 1.0) and torch.all(pix[:, 20:, :] == -1.0)
    assert torch.all(pix[:, :, 30:] == -1.0)


def test_exif_orientation_applied():
    arr = np.zeros((20, 40, 3), dtype=np.uint8)
    arr[:, :20] = 255  # left half white
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to display
    Image.fromarray(arr).save(buf, format="JPEG", exif=exif.tobytes(), quality=100)
    img = load_image(buf.getvalue())
    assert img.size == (20, 40)  # displayed upright: width and height swapped
    top = np.asarray(img.convert("L"))[:10].mean()
    assert top > 200  # the white half is now on top


def test_same_picture_same_hash_other_picture_other_hash():
    a = Image.new("RGB", (32, 32), (10, 20, 30))
    b = Image.new("RGB", (32, 32), (10, 20, 31))
    p = ImageProcessor()
    assert p(a).mm_hash == p(a.copy()).mm_hash != p(b).mm_hash


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "empty"),
        (b"not an image at all", "not an image"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 20, "not an image|corrupt"),
    ],
)
def test_bad_bytes(data, match):
    with pytest.raises(ImageError, match=match):
        load_image(data)


def test_truncated_png():
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)).save(
        buf, format="PNG"
    )
    with pytest.raises(ImageError, match="corrupt|truncated|not an image"):
        load_image(buf.getvalue()[: len(buf.getvalue()) // 2])


def test_decompression_bomb_refused_from_header():
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG")  # 400 Mpx, a few KB
    assert len(buf.getvalue()) < 200_000
    with pytest.raises(ImageError, match="too large"):
        load_image(buf.getvalue())


def test_real_processor():
    pytest.importorskip("torchvision")
    from transformers import Kimi_K25ImageProcessor

    hf = Kimi_K25ImageProcessor()
    rng = np.random.default_rng(1)
    for w, h, mode in ((640, 480, "RGB"), (33, 1000, "RGBA"), (9000, 50, "L"), (300, 301, "P")):
        img = _image(rng, w, h, mode)
        ref = hf(images=[img], return_tensors="pt")
        got = ImageProcessor()(img)
        assert tuple(ref["image_grid_thw"][0].tolist()) == (1, *got.grid_hw)
        torch.testing.assert_close(got.pixel_values, ref["pixel_values"], rtol=0, atol=1e-5)

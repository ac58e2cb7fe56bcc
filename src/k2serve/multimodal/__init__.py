"""Image inputs for K2.5 / K2.6 (design decision 15: images are inputs, not a second engine).

- `image`: decode + validate bytes (`load_image`), the Kimi_K25ImageProcessor rules
  (`ImageProcessor`: NaViT resize, pad to patch * merge, normalize, patchify) and the content
  hash that keys the encoder cache and the prefix cache;
- `inputs`: `ImageInput` (one preprocessed image and where its tokens sit in the prompt) and
  the placeholder expansion (one `<|media_pad|>` per image -> its N tokens);
- `media`: fetching `image_url` values (data:, http(s)://, file://) under the server's policy.
Nothing here imports a k2serve layer; the server, the engine and `LLM` use it.
"""

"""LLM: the offline API, shaped like vLLM's so users' scripts carry over.

    from k2serve import LLM, SamplingParams
    llm = LLM()                                  # the bundled demo checkpoint
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)

`generate` and `chat` return CUMULATIVE `RequestOutput`s in the order of the prompts. All
prompts are validated before any is queued; an interrupted call aborts what it queued.
`close()` (also `with LLM(...) as llm:` and garbage collection) stops tensor-parallel workers.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from k2serve.engine.config import EngineConfig
from k2serve.engine.engine import LLMEngine
from k2serve.engine.outputs import RequestOutput
from k2serve.engine.sampling_params import SamplingParams
from k2serve.multimodal.media import chat_images

if TYPE_CHECKING:
    from k2serve.engine.dp import DPEngine

Prompt = str | list[int] | dict


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        **engine_args: Any,
    ) -> None:
        """`model`: checkpoint directory (None = the demo checkpoint). `engine_args`: any
        EngineConfig field (max_model_len, max_num_seqs, kv_cache_memory, page_size, ...)."""
        cfg = EngineConfig(
            model=None if model is None else str(model),
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            seed=seed,
            **engine_args,
        )
        self.llm_engine: LLMEngine | DPEngine
        if cfg.data_parallel_size > 1:  # one engine per data-parallel rank (issue 29)
            from k2serve.engine.dp import DPEngine

            self.llm_engine = DPEngine(cfg)
        else:
            self.llm_engine = LLMEngine(cfg)
        self._ids = itertools.count()

    # ---- lifetime: `with LLM(...) as llm:` / `llm.close()` stop tensor-parallel workers -------
    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallel); idempotent."""
        eng = getattr(self, "llm_engine", None)  # None when __init__ failed
        if eng is not None:
            eng.shutdown()

    shutdown = close

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter exit)
            pass

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    # ------------------------------------------------------------------------------------------
    def _encode(self, prompt: object) -> tuple[str | None, list[int], list]:
        """A Prompt -> (text or None, token ids, placed images). A dict may carry vLLM's
        `multi_modal_data={"image": PIL image or list}`: the prompt then names each image once
        with `<|media_pad|>`, which is expanded to the image's tokens."""
        text, ids = self._to_ids(prompt)
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not mm_data:
            return text, ids, []
        if not isinstance(mm_data, dict):
            raise ValueError("multi_modal_data must be a dict like {'image': [PIL images]}")
        unknown = set(mm_data) - {"image"}
        if unknown:
            raise ValueError(
                f"multi_modal_data: {sorted(unknown)} not supported (K2.5 takes 'image'; video "
                "is experimental and served only by Moonshot's API)"
            )
        images = mm_data.get("image") or []
        if not isinstance(images, (list, tuple)):
            images = [images]
        ids, placed = self.llm_engine.mm.process(ids, images)
        return text, ids, placed

    def _to_ids(self, prompt: object) -> tuple[str | None, list[int]]:
        """A Prompt (anything else is a ValueError) -> (text or None, token ids)."""
        if isinstance(prompt, dict):  # vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            tok = self.llm_engine.tokenizer
            if tok is None:
                raise ValueError("this checkpoint has no tokenizer: give prompts as token ids")
            return prompt, tok.encode(prompt, allow_special=True)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt (str, token ids, or a list of either), in order."""
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)
        )
        plist = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(
                    f"{len(params)} sampling_params for {len(plist)} prompts: give one, or one "
                    "per prompt"
                )
        encoded = [self._encode(p) for p in plist]
        eng = self.llm_engine
        for (_, ids, mm), sp in zip(encoded, params, strict=True):
            eng.validate(ids, sp)
            eng.mm.check_placed(ids, mm)
        rids = [f"llm-{next(self._ids)}" for _ in plist]
        for rid, (text, ids, mm), sp in zip(rids, encoded, params, strict=True):
            eng.add_request(rid, ids, sp, prompt=text, mm_inputs=mm)
        return self._run(rids, use_tqdm)

    def _run(self, rids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        eng = self.llm_engine
        results: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(rids), desc="Generating", unit="req")
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    prev = results.get(out.request_id)
                    if prev is None:
                        results[out.request_id] = out
                    else:
                        prev.merge(out)
                    if out.finished and pbar is not None:
                        pbar.update(1)
        except BaseException:
            eng.abort_request([r for r in rids if r not in results or not results[r].finished])
            while eng.has_unfinished_requests():  # drain the abort outputs
                eng.step()
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [results[r] for r in rids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template and generate."""
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("this checkpoint has no tokenizer, so no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for c in convs:
            images, c = chat_images(list(c))  # image parts -> PIL images, template parts
            text = tok.apply_chat_template(
                c, tools=tools, chat_template_kwargs=chat_template_kwargs
            )
            p: dict = {"prompt": text, "prompt_token_ids": tok.encode(text, allow_special=True)}
            if images:
                p["multi_modal_data"] = {"image": images}
            prompts.append(p)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

"""KT-Kernel (PyPI `kt-kernel`) as the peer of benchmarks/cpu_moe.py, on the same expert tensors.

Only its extension is used (loaded as its package's `_cpu_detect.initialize()` does, without
importing the package's Python wrappers, which need extra packages): a `CPUInfer` worker pool,
a `MOEConfig` pointing at our experts' tensors (RAWINT4 = compressed-tensors pack-quantized
INT4, as KTransformers serves Kimi-K2-Thinking; FP8 = 128x128 blocks; BF16), the backend class
its own wrapper selects for that method, `load_weights_task`, then `forward_task` per call with
bf16 input / output buffers as its wrapper allocates them.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def load_ext():
    """(kt_kernel_ext, variant) or an ImportError."""
    spec = importlib.util.find_spec("kt_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("kt_kernel is not installed")
    d = list(spec.submodule_search_locations)[0]
    det = importlib.util.spec_from_file_location("kt_cpu_detect", os.path.join(d, "_cpu_detect.py"))
    mod = importlib.util.module_from_spec(det)
    det.loader.exec_module(mod)
    return mod.initialize()


def _backend(ext, method: str):
    m = ext.moe
    names = {
        "int4": ["AMXInt4_KGroup_MOE", "AVXVNNI256RawInt4_MOE", "AVX2RawInt4_MOE"],
        "fp8": ["AMXFP8_MOE", "AVX2FP8_MOE"],
        "bf16": ["AMXBF16_MOE", "AVX2BF16_MOE"],
    }[method]
    for n in names:
        cls = getattr(m, n, None)
        if cls is not None:
            return n, cls
    raise RuntimeError(f"no KT-Kernel backend for {method} in this build ({names})")


class KtLayer:
    """Callable like an expert backend: (x [T, H] bf16, ids [T, k], w [T, k]) -> [T, H] bf16."""

    def __init__(self, experts, fmt, hidden, inter, E, k, threads, max_tokens=4096):
        ext, variant = load_ext()
        self.ext, self.k, self.hidden = ext, k, hidden
        wcfg = ext.WorkerPoolConfig()
        wcfg.subpool_count = 1
        wcfg.subpool_numa_map = [0]
        wcfg.subpool_thread_count = [threads]
        self.cpu_infer = ext.CPUInfer(wcfg)
        self.keep = []

        def tensors(proj):
            ws, ss = [], []
            for ex in experts:
                lin = getattr(ex, proj)
                if fmt == "int4":
                    w = lin.weight_packed.detach().contiguous().view(torch.uint8)
                    s = lin.weight_scale.detach().contiguous()
                elif fmt == "fp8":
                    w = lin.weight.detach().contiguous()
                    s = lin.weight_scale_inv.detach().float().contiguous()
                else:
                    w, s = lin.weight.detach().bfloat16().contiguous(), None
                ws.append(w)
                ss.append(s)
            self.keep += ws + [s for s in ss if s is not None]
            return [[w.data_ptr() for w in ws]], [[s.data_ptr() if s is not None else 0
                                                    for s in ss]]  # fmt: skip

        self.mask = torch.zeros(E, dtype=torch.bool)  # no expert on the GPU
        cfg = ext.moe.MOEConfig(E, k, hidden, inter, self.mask.data_ptr())
        cfg.layer_idx = 0
        cfg.pool = self.cpu_infer.backend_
        cfg.max_len = max_tokens
        cfg.gate_projs, cfg.gate_scales = tensors("gate_proj")
        cfg.up_projs, cfg.up_scales = tensors("up_proj")
        cfg.down_projs, cfg.down_scales = tensors("down_proj")
        if fmt == "int4":
            cfg.quant_config.bits = 4
            cfg.quant_config.group_size = 32
            cfg.quant_config.zero_point = False
        elif fmt == "fp8":
            cfg.quant_config.bits = 8
            cfg.quant_config.group_size = 128
            cfg.quant_config.zero_point = False
        self.backend_name, cls = _backend(ext, fmt)
        self.name = f"kt-kernel {variant} {self.backend_name}"
        self.moe = cls(cfg)
        p2l = torch.arange(E, dtype=torch.long)
        self.cpu_infer.submit(self.moe.load_weights_task(p2l.data_ptr()))
        self.cpu_infer.sync()
        self.bsz = torch.zeros(1, dtype=torch.int32)

    def __call__(self, x, ids, w):
        T = x.shape[0]
        xin = x.to(torch.bfloat16).contiguous()
        ids = ids.to(torch.long).contiguous()
        w = w.to(torch.float32).contiguous()
        out = torch.zeros(T, self.hidden, dtype=torch.bfloat16)
        self.bsz[0] = T
        task = self.moe.forward_task(self.bsz.data_ptr(), self.k, ids.data_ptr(), w.data_ptr(),
                                     xin.data_ptr(), out.data_ptr(), False)  # fmt: skip
        self.cpu_infer.submit(task)
        self.cpu_infer.sync()
        return out


def make_kt_layer(experts, fmt, hidden, inter, E, k, threads):
    return KtLayer(experts, fmt, hidden, inter, E, k, threads)

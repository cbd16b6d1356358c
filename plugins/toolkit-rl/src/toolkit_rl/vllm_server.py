"""The ``vllm`` rollout backend in server mode (``--vllm-server URL``): rollouts from a running ``vllm serve``.

The server samples through its OpenAI completions endpoint (prompt token ids in, completion token ids
out, one request per prompt with that prompt's seed, as the colocated backend seeds it). After each
rollout batch's optimizer steps the main rank writes the policy's exported tensors as safetensors
where the server can read them and asks the server to reload them in place (``/collective_rpc``
``reload_weights``, then ``/reset_prefix_cache``: vLLM's development endpoints, so the server runs
with ``VLLM_SERVER_DEV_MODE=1``). Only the standard library speaks to it: the training process needs
no vLLM. Old log-probs come from the HF copy, as with the colocated engine.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from toolkit_rl.rollout import Completions, HFRollouts, RolloutError

START = "VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --generation-config vllm --port PORT"


def request(url: str, method: str, path: str, body: dict | None = None, *, what: str, timeout: float) -> Any:
    """One JSON request to the server; any failure is a one-line :class:`RolloutError` naming the server."""
    data = None if body is None else json.dumps(body).encode()
    message = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(message, timeout=timeout) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise RolloutError(f"rollout backend 'vllm' (server {url}) failed {what}: HTTP {exc.code} {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RolloutError(f"rollout backend 'vllm' cannot reach the server at {url} ({what}): {reason}. "
                           f"Start it as `{START}` and pass --vllm-server http://HOST:PORT") from None
    return json.loads(text) if text.strip() else None


def check_server(url: str) -> str:
    """The served model's name; a server that cannot be reached or has no development endpoints is named.
    ``toolkit grpo --vllm-server URL`` calls it before any model loads."""
    url = url.rstrip("/")
    models = request(url, "GET", "/v1/models", what="listing its models", timeout=30)["data"]
    if not models:
        raise RolloutError(f"rollout backend 'vllm' (server {url}) serves no model")
    try:
        request(url, "GET", "/is_sleeping", what="checking its development endpoints", timeout=30)
    except RolloutError as exc:
        if "HTTP 404" not in str(exc):
            raise
        raise RolloutError(f"rollout backend 'vllm' (server {url}) has no development endpoints, through which "
                           f"the policy's weights are loaded after each step: start it as `{START}`") from None
    return models[0]["id"]


class VLLMServerRollouts(HFRollouts):
    """Sampling on a ``vllm serve`` process; weights handed over through a safetensors file it reads."""

    name = "vllm"

    def __init__(self, source: Any, recipe: Any, config: Any, device: Any):
        self.url = config.vllm_server.rstrip("/")
        self.timeout = float(os.environ.get("TOOLKIT_VLLM_SERVER_TIMEOUT", "600"))
        self.model_name = check_server(self.url)
        super().__init__(source, recipe, config, device)
        root = os.environ.get("TOOLKIT_VLLM_WEIGHTS_DIR") or None  # a directory the server reads too (shared storage)
        # scratch space, not an output: removed at close, or at exit if the run dies before close
        self._scratch = tempfile.TemporaryDirectory(prefix="toolkit-rollout-weights-", dir=root)
        self.weights_dir = Path(self._scratch.name)

    def request(self, method: str, path: str, body: dict | None = None, *, what: str) -> Any:
        return request(self.url, method, path, body, what=what, timeout=self.timeout)

    def load_weights(self, tensors: Any) -> None:
        import torch.distributed as dist

        from toolkit.hfdir import write_safetensors_shards

        pairs = list(tensors)
        super().load_weights(pairs)
        main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        # one server for every rank: the main rank updates it. The run's check after this call (an all-reduce of
        # failures, GRPORun.backend_call) keeps the other ranks from sampling before the server holds the new weights.
        if main:
            # one shard, written under a hidden name and renamed over the last one: the server never reads half a file
            write_safetensors_shards(pairs, self.weights_dir, max_shard_bytes=2**62)
            self.request("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(self.weights_dir)}},
                         what="loading the policy's weights")
            self.request("POST", "/reset_prefix_cache", {}, what="resetting its prefix cache")

    def generate(self, prompts: list[list[int]], seed: int) -> Completions:
        c = self.config

        def sample(index: int, prompt: list[int]) -> dict:
            body = {"model": self.model_name, "prompt": prompt, "n": c.num_generations, "temperature": c.temperature,
                    "top_p": c.top_p, "top_k": c.top_k or 0, "max_tokens": c.max_new_tokens,
                    "seed": (seed + index) % 2**31, "return_token_ids": True}
            return self.request("POST", "/v1/completions", body, what="sampling")

        with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), 32))) as pool:  # the server batches them
            responses = list(pool.map(sample, range(len(prompts)), prompts))
        ids, truncated = [], []
        for response in responses:
            for choice in sorted(response["choices"], key=lambda choice: choice["index"]):
                ids.append(list(choice["token_ids"]))
                truncated.append(choice["finish_reason"] == "length")
        rows = [p for p in prompts for _ in range(c.num_generations)]
        return Completions(ids, truncated, self.sampling_entropy(rows, ids))

    def close(self) -> None:
        super().close()
        self._scratch.cleanup()

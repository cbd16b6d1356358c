"""CPU compatibility for Megatron-Core: redirect its hard-coded CUDA call sites to the CPU.

Megatron-Core 0.16 assumes CUDA in a few places (RNG tracker, ``torch.cuda.current_device()``
as an allocation device, zeros on ``"cuda"`` in the pipeline schedules, CUDA streams/events in
p2p communication, ``param.type() == 'torch.cuda.FloatTensor'`` in the optimizers). Without CUDA,
:func:`cpu_compat` (a re-entrant context manager) makes those sites run on the CPU:

* a torch function mode rewrites ``device="cuda"`` / ``torch.device("cuda")`` / integer devices
  to ``"cpu"``, makes ``Tensor.cuda()`` a no-op and answers ``Tensor.type()`` with the CUDA name
  the optimizers check for;
* ``torch.cuda`` RNG, stream, event and synchronize functions become CPU equivalents or no-ops;
* Megatron's own RNG helpers (``_get_cuda_rng_state`` / ``_set_cuda_rng_state``) use the CPU
  generator, so the model-parallel RNG tracker forks the CPU generator.

With CUDA present every function here is a no-op. :func:`redirected_sites` lists the
``file:line`` call sites that were rewritten, for tests and debugging.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.RLock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []
_mode: Any = None
_sites: set[str] = set()

_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def redirected_sites() -> list[str]:
    """``file:line`` of every call site the CPU layer rewrote so far (sorted)."""
    return sorted(_sites)


def _note_site() -> None:
    frame = sys._getframe(1)
    while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename.endswith("compat.py")):
        frame = frame.f_back
    if frame is not None:
        name = frame.f_code.co_filename
        short = name[name.find("megatron/"):] if "megatron/" in name else name.rsplit("/", 1)[-1]
        _sites.add(f"{short}:{frame.f_lineno}")


def _is_cuda_device(value: Any) -> bool:
    import torch

    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, torch.device) and value.type == "cuda"


def _make_mode() -> Any:
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                _note_site()
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                return _CUDA_TYPE_NAMES.get(name, name)
            if "device" in kwargs and _is_cuda_device(kwargs["device"]):
                _note_site()
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
                _note_site()
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    return CudaToCpu()


class _NullStream:
    """Stands in for ``torch.cuda.Stream``/``Event`` on the CPU: every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: _NullStream()  # record_event() etc. return something to call

    def __eq__(self, other: object) -> bool:  # one CPU "stream": no side streams to wait on
        return isinstance(other, _NullStream)

    def __hash__(self) -> int:
        return 0

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def elapsed_time(self, other: Any) -> float:
        return 0.0

    def query(self) -> bool:
        return True


def _patch(owner: Any, name: str, value: Any) -> None:
    _saved.append((owner, name, getattr(owner, name, None)))
    setattr(owner, name, value)


def _install() -> None:
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    def get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        # The MoE alltoall dispatcher needs its split sizes as numpy on the host; Megatron only
        # converts CUDA tensors, so on the CPU they would stay tensors and all_to_all rejects them.
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    from megatron.core.transformer.moe import token_dispatcher

    cuda = torch.cuda
    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", move_to_cpu)
    _patch(mrandom, "_get_cuda_rng_state", get_rng_state)
    _patch(mrandom, "_set_cuda_rng_state", set_rng_state)
    _patch(cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _patch(cuda.random, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _patch(cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state))
    _patch(cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    # A device, not an index: backward passes run outside the function mode, so an int would mean cuda:N.
    _patch(cuda, "current_device", lambda: torch.device("cpu"))
    _patch(cuda, "synchronize", lambda device=None: None)
    _patch(cuda, "empty_cache", lambda: None)
    _patch(cuda, "Stream", _NullStream)
    _patch(cuda, "Event", _NullStream)
    _patch(cuda, "current_stream", lambda device=None: _NullStream())
    _patch(cuda, "default_stream", lambda device=None: _NullStream())
    _patch(cuda, "stream", lambda stream=None: contextlib.nullcontext())
    _patch(cuda, "set_device", lambda device: None)


def _uninstall() -> None:
    while _saved:
        owner, name, value = _saved.pop()
        setattr(owner, name, value)


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Run Megatron-Core on the CPU (no-op when CUDA is available). Re-entrant."""
    global _depth, _mode
    if cuda_available():
        yield
        return
    with _lock:
        outermost = _depth == 0
        if outermost:
            _install()
            _mode = _make_mode()
            _mode.__enter__()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if outermost:
                _mode.__exit__(None, None, None)
                _mode = None
                _uninstall()


def mla_without_transformer_engine() -> None:
    """Let megatron-core 0.16's ``MultiLatentAttention`` build without Transformer Engine.

    Its module imports ``TELinear`` from megatron's TE extension, which without TE is a stand-in object,
    not a class, while ``HAVE_TE`` stays true; ``isinstance(linear_proj, TELinear)`` then raises
    TypeError. With no real TE class there is no TE path to take, so the flag is set false.
    """
    from megatron.core.transformer import multi_latent_attention

    if multi_latent_attention.HAVE_TE and not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def router_expert_bias_with_padding(model: Any) -> int:
    """Make the routers' expert-bias token counting take a padding mask (megatron-core 0.16).

    With ``moe_router_enable_expert_bias`` the router counts routed tokens per expert as
    ``routing_map & ~padding_mask``: a ``[tokens, experts]`` map and a ``[tokens]`` mask, which do not
    broadcast, so any padded micro-batch fails. The count is masked per token here instead. Returns the
    number of routers changed.
    """
    import types

    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    def count_routed(self: Any, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    changed = 0
    for module in model.modules():
        if isinstance(module, TopKRouter) and getattr(module, "enable_expert_bias", False):
            module._apply_expert_bias = types.MethodType(count_routed, module)
            changed += 1
    return changed
